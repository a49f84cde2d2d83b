"""ferrosync/testing/measure.py: sizes as the benchmarks and drills take and print them,
and this process's resident set."""

import pytest

from ferrosync.testing.measure import human, parse_size, peak_rss_mb, reset_peak_rss, rss_mb


@pytest.mark.parametrize("text, n", [("64KiB", 64 << 10), ("1.5MiB", 3 << 19),
                                     ("2gib", 2 << 30), ("512B", 512), (" 4096 ", 4096)])
def test_parse_size(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text", ["", "MiB", "1TiB", "big"])
def test_parse_size_refuses_what_is_no_size(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_human_uses_the_largest_unit_that_divides():
    assert [human(n) for n in (16 << 20, 3 << 30, 1536, 1 << 10, 7)] == [
        "16 MiB", "3 GiB", "1536 B", "1 KiB", "7 B"]
    assert all(parse_size(human(n).replace(" ", "")) == n for n in (16 << 20, 1536, 7))


def test_the_peak_follows_an_allocation_after_a_reset():
    reset_peak_rss()
    base = rss_mb()
    block = bytearray(64 << 20)  # 64 MiB, touched: resident
    block[::4096] = b"x" * len(block[::4096])
    assert peak_rss_mb() >= base + 60
    del block


def test_a_row_whose_ranks_disagree_fails_the_benchmark_and_is_named(capsys):
    from ferrosync.testing.measure import ranks_agreed

    rows = [{"name": "grad", "ranks_agree": True}, {"name": "diloco", "ranks_agree": False}]
    assert ranks_agreed(rows[:1], lambda r: r["name"]) == 0
    assert ranks_agreed(rows, lambda r: r["name"]) == 1
    assert capsys.readouterr().err == "diloco: ranks ended with DIFFERENT parameters\n"

"""``elastic/job.py``: the job record a member checks before it writes anything, and the
end mark, over a ``MemoryStorage`` (tests/fakes.py).

The shared settings are the options class's own (``ElasticOptions.shared_settings`` and
``shared_defaults``): the first member writes them with its spec, every later one is
refused with every difference named, a record written before a setting existed counts
as its default, a record sealed with another key names the secret, and a member that
loses the race to write the record checks the winner's. Admission through rosters is
tests/test_elastic_rounds.py's.
"""

from __future__ import annotations

import re

import pytest

from fakes import MemoryStorage
from ferrosync.elastic.job import check_ended, check_record, mark_ended
from ferrosync.elastic.options import ElasticOptions
from ferrosync.errors import ConfigError, JobEnded, ShardCorrupt
from ferrosync.storage import names
from ferrosync.storage.objects import Objects
from ferrosync.storage.wire import decode_record, encode_record, job_key, job_tag

NS = names.elastic_namespace("unit")
SECRET = job_key(b"team secret", NS)
URL = "mem://test"
DEFAULTS = ElasticOptions.shared_defaults()
SPEC = {"model": "mlp", "lr": 0.1}


@pytest.fixture
def storage():
    return MemoryStorage(URL)


def layer(storage, secret=SECRET):
    return Objects(storage, NS, key=secret, tag=job_tag(NS), poll=(0.01, 0.1))


def shared(**options):
    return ElasticOptions(**options).shared_settings()


def record_key():
    return names.within(NS, names.ELASTIC_JOB_RECORD)


def join(storage, spec=SPEC, secret=SECRET, **options):
    check_record(layer(storage, secret), spec, shared(**options), DEFAULTS, URL)


def test_the_first_member_writes_the_record_and_the_next_ones_only_read_it(storage):
    join(storage, fan_in=4)
    record = decode_record(storage.objects[record_key()], SECRET, path="job")
    assert record == {"spec": SPEC, **shared(fan_in=4)}
    assert set(shared()) == set(DEFAULTS)  # one home for what every member shares
    join(storage, fan_in=4)
    join(storage, spec=None, fan_in=4)  # a plain connect states no spec: nothing to compare
    assert storage.requests("put") == [record_key()]


@pytest.mark.parametrize("theirs, mine, words", [
    ({"fan_in": 4}, {"fan_in": 8}, "the job runs with fan_in 4 (here 8)"),
    ({"wire_dtype": "bfloat16"}, {}, "the job runs with wire_dtype 'bfloat16' (here None)"),
])
def test_a_member_with_another_shared_setting_is_refused_naming_it(storage, theirs, mine,
                                                                   words):
    join(storage, **theirs)
    with pytest.raises(ConfigError, match=re.escape(
            f"does not fit the elastic job at {URL}: {words}")) as info:
        join(storage, **mine)
    setting = next(iter(theirs))
    assert f"start every member with the same {setting}" in info.value.hint
    assert info.value.path == storage.path_of(record_key())


def test_a_record_that_predates_a_setting_counts_as_its_default(storage):
    storage.put(record_key(), [encode_record({"spec": SPEC}, SECRET)])  # an older member's
    join(storage, fan_in=DEFAULTS["fan_in"])
    with pytest.raises(ConfigError, match=f"fan_in {DEFAULTS['fan_in']} \\(here 3\\)"):
        join(storage, fan_in=3)


def test_every_difference_of_the_spec_is_named(storage):
    join(storage)
    with pytest.raises(ConfigError, match=r"the job runs with lr 0.1 \(here 0.2\); model "
                                          r"'mlp' \(here 'cnn'\); steps None \(here 5\)"):
        join(storage, spec={"model": "cnn", "lr": 0.2, "steps": 5})


@pytest.mark.parametrize("spec", [{"f": object()}, {"x": float("nan")}])
def test_a_spec_that_is_not_plain_json_is_refused_before_any_io(storage, spec):
    with pytest.raises(ConfigError, match="spec must be plain JSON"):
        join(storage, spec=spec)
    assert storage.log == []


@pytest.mark.parametrize("written, mine, words", [
    (job_key(b"other secret", NS), SECRET, "this member's secret differs from the job's"),
    (SECRET, None, "sealed with a secret and this member has none"),
])
def test_a_record_sealed_with_another_key_names_the_secret(storage, written, mine, words):
    join(storage, secret=written)
    with pytest.raises(ConfigError, match=words) as info:
        join(storage, secret=mine)
    assert "FERROSYNC_SECRET" in info.value.hint


def test_a_record_without_a_spec_is_refused_as_corrupt(storage):
    storage.put(record_key(), [encode_record({"spec": ["not", "a", "dict"]}, SECRET)])
    with pytest.raises(ShardCorrupt, match="holds no spec"):
        join(storage)


def test_a_member_that_loses_the_race_checks_the_winners_record(storage):
    # another member creates the record between this one's read and its create
    storage.before("put", record_key(), lambda key: check_record(
        layer(storage), {"model": "cnn"}, shared(), DEFAULTS, URL))
    with pytest.raises(ConfigError, match=r"model 'cnn' \(here 'mlp'\)"):
        join(storage)
    assert decode_record(storage.objects[record_key()], SECRET, path="job")["spec"] == {
        "model": "cnn"}


def test_the_first_end_mark_wins_and_later_joiners_are_told_at_once(storage):
    objects = layer(storage)
    check_ended(objects)  # not ended: nothing
    mark_ended(objects, 7, "a" * 16)
    mark_ended(objects, 9, "b" * 16)  # too late: the job ended at round 7
    with pytest.raises(JobEnded, match="the elastic job ended at round 7") as info:
        check_ended(objects)
    assert "start another job" in info.value.hint
    forged = layer(storage, secret=job_key(b"other", NS))
    with pytest.raises(ShardCorrupt):
        check_ended(forged)  # read with another key: refused, never trusted

"""``core/validate.py``: the one wording of a bad value, and the bounds each check applies."""

from __future__ import annotations

import argparse
import math
import re

import pytest

from ferrosync.core import validate
from ferrosync.errors import ConfigError


def test_error_has_the_one_wording_with_source_rank_and_hint():
    err = validate.error("timeout", "a positive number", -1, source="torchrun", rank=3,
                         hint="pass timeout=60")
    assert isinstance(err, ConfigError) and err.rank == 3
    assert str(err) == ("rank 3: timeout must be a positive number, got -1 (from torchrun); "
                        "pass timeout=60")
    assert validate.error("x", "a tensor", object(), got="shape (2, 3)").what == (
        "x must be a tensor, got shape (2, 3)")


@pytest.mark.parametrize("kwargs, wanted", [
    ({"minimum": 1}, "a positive int"),
    ({"minimum": 0, "maximum": 7}, "an int in [0, 7]"),
    ({"minimum": 2}, "an int >= 2"),
    ({"maximum": 9}, "an int <= 9"),
    ({}, "an int"),
])
def test_integer_names_its_bounds(kwargs, wanted):
    with pytest.raises(ConfigError, match=rf"^n must be {re.escape(wanted)}, "):
        validate.integer("n", 1.5, **kwargs)


@pytest.mark.parametrize("value", [True, False, 1.0, "3", None, -1, 11])
def test_integer_refuses_bools_floats_strings_and_out_of_range(value):
    with pytest.raises(ConfigError):
        validate.integer("n", value, minimum=0, maximum=10)


def test_integer_accepts_its_bounds_and_none_when_allowed():
    assert validate.integer("n", 0, minimum=0, maximum=10) == 0
    assert validate.integer("n", 10, minimum=0, maximum=10) == 10
    assert validate.integer("n", None, allow_none=True) is None


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, True, "1", None])
def test_number_refuses_non_finite_bools_and_strings(value):
    with pytest.raises(ConfigError, match="must be a finite number"):
        validate.number("lr", value)


def test_number_bounds_and_unit():
    assert validate.number("lr", 2) == 2.0 and isinstance(validate.number("lr", 2), float)
    with pytest.raises(ConfigError, match=r"^t must be a positive number of seconds, got 0"):
        validate.number("t", 0, positive=True, unit="seconds")
    with pytest.raises(ConfigError, match=r"must be a number in \[0, 1\], got 1.5"):
        validate.number("p", 1.5, minimum=0, maximum=1)
    with pytest.raises(ConfigError, match=r"must be a number >= 0.5, got 0.25"):
        validate.number("p", 0.25, minimum=0.5)
    assert validate.number("p", None, allow_none=True) is None


def test_boolean_and_choice():
    assert validate.boolean("flag", False) is False
    with pytest.raises(ConfigError, match="flag must be True or False, got 1"):
        validate.boolean("flag", 1)
    assert validate.choice("wire", "int8", ["float32", "int8"]) == "int8"
    with pytest.raises(ConfigError, match="wire must be one of 'float32', 'int8', got 'x'"):
        validate.choice("wire", "x", ["float32", "int8"])


def test_cli_number_parses_and_bounds_like_the_api():
    parse = validate.cli_number(int, positive=True)
    assert parse("3") == 3 and parse.__name__ == "int"
    with pytest.raises(argparse.ArgumentTypeError, match="must be an integer > 0, got '0'"):
        parse("0")
    with pytest.raises(argparse.ArgumentTypeError, match="must be an integer, got '1.5'"):
        parse("1.5")
    parse = validate.cli_number(float, minimum=0.0)
    assert parse("0") == 0.0
    for text in ("nan", "inf", "-0.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)

"""Hostile JSON (tandem.envs.bounded_json): nesting and number length refused before the parser runs, at exactly
the bounds, whatever the strings hold, and in time linear in the text."""

from __future__ import annotations

import json
import time

import pytest

from tandem.envs.bounded_json import MAX_DEPTH, MAX_DIGITS, JsonRefused, JsonTooLarge, check_bounds, loads


def nested(depth: int, open_: str = "[", close: str = "]") -> str:
    return open_ * depth + close * depth


def test_the_bounds_are_exact():
    assert loads(nested(MAX_DEPTH)) == json.loads(nested(MAX_DEPTH))
    assert loads('{"a": ' * MAX_DEPTH + "1" + "}" * MAX_DEPTH)["a"]
    with pytest.raises(JsonTooLarge, match=f"{MAX_DEPTH + 1} deep, more than {MAX_DEPTH}"):
        loads(nested(MAX_DEPTH + 1))
    with pytest.raises(JsonTooLarge, match="deep"):
        loads("[" * 1000 + "{" * 1000)  # unclosed counts too
    assert loads("1" * MAX_DIGITS) == int("1" * MAX_DIGITS)
    for number in ("1" * (MAX_DIGITS + 1), "-" + "9" * 4301, "0." + "5" * 2000, "1e" + "7" * 5000):
        with pytest.raises(JsonTooLarge, match=f"more than {MAX_DIGITS} digits"):
            loads(f'{{"x": [{number}]}}')


@pytest.mark.parametrize(
    "text",
    [
        '"' + "[" * 1000 + "1" * 5000 + '"',
        '{"s": "\\"' + "{" * 500 + '\\\\", "t": "' + "9" * 5000 + '"}',
        '["\\u005b' + "]" * 200 + '"]',
    ],
)
def test_brackets_and_digits_inside_strings_do_not_count(text):
    assert loads(text) == json.loads(text)


@pytest.mark.parametrize("text", ["", "{", '{"a": 1,}', "[1] 2", '"unclosed [[[', "NaNa", "\\"])
def test_anything_else_unreadable_is_refused_as_invalid_json(text):
    with pytest.raises(JsonRefused, match="is not valid JSON") as refused:
        loads(text)
    assert type(refused.value) is JsonRefused and isinstance(refused.value, ValueError)


def test_the_scan_is_linear_on_inputs_a_naive_one_is_slow_on():
    # An unclosed string of escaped quotes: a string pattern that must find its closing quote retries at each
    # one, quadratic in the length (5 MB: days). Digit runs just under the bound: a digit search that restarts
    # inside each run takes MAX_DIGITS / 2 steps a digit (30 MB: half a minute). Scanned linearly, each takes
    # well under a second.
    quotes = '"' + '\\"' * 2_500_000
    runs = ("1" * MAX_DIGITS + ",") * 30_000
    started = time.monotonic()
    check_bounds(quotes)
    check_bounds(runs)
    assert time.monotonic() - started < 20

"""JSON that a model or a client wrote, read only once its nesting and its numbers are known to be bounded.

`json.loads` recurses once per nesting level, so a reply of 1,000 `[` raises RecursionError, and it converts an
integer of more than `sys.get_int_max_str_digits()` (4,300) digits by raising ValueError; what it returns goes on
to `json.dumps`, chat templates and schema checks, which recurse as deep again. `loads` first scans the text
outside its strings (a few regular-expression passes, linear in its length) and refuses either before the parser
runs; whatever else goes wrong is the same `JsonRefused`, a ValueError whose message says what is wrong, so a
caller turns every failure into one answer (a malformed tool call the model reads, a 400).
"""

from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

MAX_DEPTH = 64
"""Arrays and objects nested in one another: far beyond any tool's arguments, far below the interpreter's stack."""
MAX_DIGITS = 1000
"""Digits in a row (an integer, a fraction, an exponent): far below the integer conversion limit of 4,300."""

_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)', re.DOTALL)
"""A JSON string, or an unclosed one to the end of the text; possessive, so no match ever backtracks."""
_LONG_DIGITS = re.compile(rf"(?<![0-9])[0-9]{{{MAX_DIGITS + 1}}}")
"""More than MAX_DIGITS digits in a row; anchored at a run's first digit, so each run is scanned once."""
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


class JsonRefused(ValueError):
    """Text that is not JSON, or JSON nested deeper or with longer numbers than this module reads."""


class JsonTooLarge(JsonRefused):
    """Valid or not, JSON past MAX_DEPTH or MAX_DIGITS: refused before the parser ran."""


def check_bounds(text: str) -> None:
    """JsonTooLarge if `text`, outside its strings, nests deeper than MAX_DEPTH or has a number of more than
    MAX_DIGITS digits."""
    outside_strings = _STRING.sub('""', text)
    if _LONG_DIGITS.search(outside_strings):
        raise JsonTooLarge(f"has a number of more than {MAX_DIGITS} digits")
    brackets = _NOT_BRACKET.sub("", outside_strings)
    depth = max(accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0)
    if depth > MAX_DEPTH:
        raise JsonTooLarge(f"nests arrays and objects {depth} deep, more than {MAX_DEPTH}")


def loads(text: str) -> Any:
    """`json.loads(text)` once `check_bounds` passes; JsonRefused (its message: `is not valid JSON (...)`, or the
    bound it passes) for anything it cannot read."""
    check_bounds(text)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as error:  # JSONDecodeError; and whatever the bounds did not foresee
        raise JsonRefused(f"is not valid JSON ({error})") from None

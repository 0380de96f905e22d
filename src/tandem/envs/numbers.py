"""Pull numeric answers out of model text: commas, currency, units, markdown and `\\boxed{}` tolerated.

Numbers are returned in one canonical string form ("1234", "-3.5", "0.25"), so
comparing two answers is comparing two strings.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A number not glued to a preceding word or number: 1,234.5 / 1234 / -3.5 / .5 / -$18
_NUMBER = re.compile(r"(?<![\w.])-?\$?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|(?<![\w.])-?\.\d+")


def normalize_number(text: str) -> str | None:
    """Canonical form of one number ("1,234.50" -> "1234.5", "72.0" -> "72"); None if it is not one."""
    try:
        value = Decimal(text.replace(",", "").replace("$", "").strip())
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def find_numbers(text: str) -> list[str]:
    """Every number in `text`, in order, canonicalised."""
    text = text.replace("\u2212", "-")  # typographic minus
    return [n for n in map(normalize_number, _NUMBER.findall(text)) if n is not None]


def extract_final_number(text: str) -> str | None:
    """The last number in `text` (the usual convention for a final answer), or None."""
    numbers = find_numbers(text)
    return numbers[-1] if numbers else None


def extract_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (nested braces allowed), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i]
            depth -= 1
    return None

"""The content split: a fixed share of a dataset's *content* (which fact a question asks, not which index
names it) is reserved for the unseen evaluation, so that set asks only questions training cannot ask.

Why by content: a small content space (cpu-learn's two one-digit terms give about 190 facts) is covered
by a few hundred training draws, so a set held out by index alone asks facts the node has trained on.
A task's content key names its fact the same way in every dataset that can ask it ("Calculate 3 + 5."
in basic_arithmetic and "... 5 + 3 =" in chain_sum are one key), and the split is a stable hash of that
key (sha256, never Python's salted hash()), so every node and run reserves the same facts.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from typing import Any

SPLIT_TAG = "sapo-unseen-v1"  # part of the hashed text: a new split gets a new tag, never a silent change
_PLUS_MINUS = re.compile(r"-?\d+(?:[+-]\d+)*")
_TERM = re.compile(r"([+-]?)(\d+)")


def arithmetic_key(entry: dict[str, Any]) -> str | None:
    """The fact an arithmetic question asks, from the entry's metadata expression. A sum of signed terms
    (only + and -) is the sorted multiset of its terms, so "3 + 5" and "5 + 3" are one fact and "8 - 3"
    another; any other expression (products, parentheses) is its text without spaces."""
    expression = (entry.get("metadata") or {}).get("expression")
    if not isinstance(expression, str) or not expression.strip():
        return None
    flat = "".join(expression.split())
    if not _PLUS_MINUS.fullmatch(flat):
        return "expr:" + flat
    terms = sorted((int(digits), sign or "+") for sign, digits in _TERM.findall(flat))
    return "sum:" + " ".join(f"{sign}{value}" for value, sign in terms)


# dataset -> its content key; datasets without one are never reserved (their sets stay held out by index)
CONTENT_KEYS: dict[str, Callable[[dict[str, Any]], str | None]] = {
    "basic_arithmetic": arithmetic_key,
    "chain_sum": arithmetic_key,
}


def content_key(dataset: str, entry: dict[str, Any]) -> str | None:
    keyer = CONTENT_KEYS.get(dataset)
    return keyer(entry) if keyer is not None else None


def key_fraction(key: str) -> float:
    """Where a key falls in [0, 1): the first 8 bytes of sha256(tag | key), the same on every machine."""
    digest = hashlib.sha256(f"{SPLIT_TAG}|{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def is_reserved(dataset: str, entry: dict[str, Any], share: float) -> bool:
    """Whether the split with this share reserves the entry's fact for the unseen evaluation."""
    if share <= 0:
        return False
    key = content_key(dataset, entry)
    return key is not None and key_fraction(key) < share

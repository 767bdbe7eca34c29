"""Splitting a command line's lists without importing anything heavy."""

from __future__ import annotations


def split_top_level(text: str) -> list[str]:
    """`text` split at its top-level commas: not inside brackets or quotes (`a=1,b=[x,y]` -> `a=1`,
    `b=[x,y]`); empty items dropped."""
    items, depth, quote, current = [], 0, "", ""
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{(":
            depth += 1
        elif char in "]})":
            depth -= 1
        elif char == "," and depth == 0:
            items.append(current)
            current = ""
            continue
        current += char
    return [item for item in [*items, current] if item.strip()]

"""Argument types the data commands share (extract, merge, export, check-draft, serve).

An old spelling of a flag or a value is still accepted and prints one deprecation line to stderr
(:class:`DeprecatedFlag`, :func:`renamed_value`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["DeprecatedFlag", "positive_finite", "positive_int", "positive_int_for", "renamed_value"]


def positive_int(text: str, what: str | None = None) -> int:
    """``text`` as an integer of at least 1; ``what`` names the quantity in the message."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1{f' ({what})' if what else ''}, got {value}")
    return value


def positive_finite(text: str) -> float:
    """A number > 0 that is not nan or infinite (``--max-in-flight-gb``)."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
    return value


def positive_int_for(what: str) -> Callable[[str], int]:
    """:func:`positive_int` as an argparse ``type`` whose message names ``what``."""
    def check(text: str) -> int:
        return positive_int(text, what)
    check.__name__ = "positive_int"
    return check


def deprecation(old: str, new: str) -> None:
    print(f"speccompat: {old} is deprecated, use {new}", file=sys.stderr)


class DeprecatedFlag(argparse.Action):
    """An old flag name (hidden from ``--help``) that sets the new flag's ``dest`` and prints one
    deprecation line naming ``new``."""

    def __init__(self, option_strings: list[str], dest: str, new: str = "", **kw: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        deprecation(str(option_string), self.new)
        setattr(namespace, self.dest, values)


def renamed_value(flag: str, renamed: dict[str, str]) -> Callable[[str], str]:
    """An argparse ``type`` taking the old values of ``flag`` (``renamed``: old -> new) to the new
    ones, with one deprecation line each."""
    def value(text: str) -> str:
        if text in renamed:
            deprecation(f"{flag} {text}", f"{flag} {renamed[text]}")
            return renamed[text]
        return text
    value.__name__ = "value"
    return value

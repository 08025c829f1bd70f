"""Command-line values: numbers checked where they are read, errors in one line.

Every entry point (planner, simulate, rehearse, the benchmarks, the trainer)
builds its parser with :class:`ArgumentParser`, whose errors are one line on
stderr and exit status 2, without a usage block or a traceback::

    python -m megatron_seq1f1b.planner: error: argument --pp: must be an integer >= 1, got '0'

and reads every number through a ``type=`` callable below, which names what is
allowed (argparse puts the flag in front). Checks that need several flags run
after parsing and report through ``parser.error`` the same way. A file a command will
write is read through :func:`output_file`, so that a folder or a missing folder is refused
before any work rather than in a traceback after it. A value that
begins with '-' where a flag takes one (``--hybrid-layer-pattern --*-*``) is
joined to its flag before argparse reads it (:data:`DASH_VALUES`).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path
from typing import Callable, NoReturn

__all__ = ["ArgumentParser", "integer", "number", "positive_int", "non_negative_int",
           "positive_float", "non_negative_float", "fraction", "output_file", "OldSpelling"]


#: Options whose values may begin with '-' (a hybrid layer pattern opening with MLP layers,
#: ``--hybrid-layer-pattern --*-*``), with the shape such a value has: argparse would read the
#: value as an option ("expected one argument"), so :class:`ArgumentParser` joins it to its flag.
DASH_VALUES = {"--hybrid-layer-pattern": re.compile(r"[-*+|/A-Z]+")}


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line: ``<prog>: error: <message>``, status 2;
    values of :data:`DASH_VALUES` options may begin with '-'."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_known_args(self, args=None, namespace=None):
        given = list(sys.argv[1:] if args is None else args)
        joined, i = [], 0
        while i < len(given):
            shape = DASH_VALUES.get(given[i])
            if shape is not None and i + 1 < len(given) and given[i + 1].startswith("-") \
                    and shape.fullmatch(given[i + 1]):
                joined.append(f"{given[i]}={given[i + 1]}")
                i += 2
            else:
                joined.append(given[i])
                i += 1
        return super().parse_known_args(joined, namespace)


def _refuse(what: str, text) -> NoReturn:
    raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")


def integer(minimum: int | None = None, maximum: int | None = None) -> Callable[[str], int]:
    """A ``type=`` for integers in ``[minimum, maximum]`` (either end open if None)."""
    if minimum is not None and maximum is not None:
        what = f"an integer from {minimum} to {maximum}"
    elif minimum is not None:
        what = f"an integer >= {minimum}"
    elif maximum is not None:
        what = f"an integer <= {maximum}"
    else:
        what = "an integer"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except (TypeError, ValueError):
            _refuse(what, text)
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            _refuse(what, text)
        return value

    parse.__name__ = "integer"
    parse.allowed = what
    return parse


def number(minimum: float | None = None, *, above: float | None = None,
           below: float | None = None) -> Callable[[str], float]:
    """A ``type=`` for finite numbers: ``>= minimum``, ``> above``, ``< below``."""
    if minimum is not None and below is not None:
        what = f"a number in [{minimum:g}, {below:g})"
    else:
        parts = ([f">= {minimum:g}"] if minimum is not None else []) + (
            [f"> {above:g}"] if above is not None else []) + (
            [f"< {below:g}"] if below is not None else [])
        what = "a number" + (" " + " and ".join(parts) if parts else "")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except (TypeError, ValueError):
            _refuse(what, text)
        if not math.isfinite(value) or (minimum is not None and value < minimum) or (
                above is not None and value <= above) or (below is not None and value >= below):
            _refuse(what, text)
        return value

    parse.__name__ = "number"
    parse.allowed = what
    return parse


positive_int = integer(1)
non_negative_int = integer(0)
positive_float = number(above=0.0)
non_negative_float = number(0.0)
fraction = number(0.0, below=1.0)  # [0, 1)


def output_file(make_folders: bool = False) -> Callable[[str], str]:
    """A ``type=`` for a file the command writes (after its work): refused as it is read if
    it names a folder, if its folder does not exist (``make_folders``: the command creates
    missing folders, so only a file standing where a folder must be is refused), or if this
    process may not write it there."""

    def parse(text: str) -> str:
        path = Path(text)
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"{text} is a directory; give a file path")
        folder = path.parent
        if make_folders:
            folder = next(f for f in (folder, *folder.parents) if f.exists())
        elif not folder.exists():
            raise argparse.ArgumentTypeError(f"folder {folder} does not exist")
        if not folder.is_dir():
            raise argparse.ArgumentTypeError(f"{folder} is a file, not a folder")
        if not os.access(path if path.exists() else folder, os.W_OK):
            raise argparse.ArgumentTypeError(f"cannot write {text} (no permission)")
        return text

    parse.__name__ = "output file"
    return parse


class OldSpelling(argparse.Action):
    """Stores like ``store``; given under ``old`` (an earlier name still accepted), it adds
    a one-line note on stderr with the new name and why it changed."""

    def __init__(self, option_strings, dest, *, old: str, why: str, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.old, self.why = old, why

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string == self.old:
            new = next(s for s in self.option_strings if s != self.old)
            print(f"{parser.prog}: note: {self.old} is now {new} ({self.why}); the old "
                  "spelling still works", file=sys.stderr)
        setattr(namespace, self.dest, values)

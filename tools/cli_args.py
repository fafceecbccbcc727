"""Argument types shared by the ``cutile-kernels`` subcommands (argparse ``type=`` callables): a bad
value ends in argparse's one-line error naming the fix, not in a traceback from deep in torch."""

from __future__ import annotations

import argparse
import os
import re
import sys

_DEVICE = re.compile(r"(cpu|cuda(:\d+)?)")


def device(text: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``: the devices the tools run on (no MPS, no other backend)."""
    if not _DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device here: use cuda (or cuda:N) for an NVIDIA GPU, "
                                         "or cpu")
    return text


def seed(text: str) -> int:
    """A random seed: an integer of at least 0 (``torch.manual_seed`` takes any, but a preset's
    folder name and a report's settings read better without a sign)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def positive(text: str) -> int:
    """An integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line (the problem, and where the usage is),
    not argparse's usage block followed by the error, and which takes ``-v``/``--verbose`` (log at
    INFO, show tracebacks) before a command or after it. Subparsers inherit the class; the
    top-level parser sets the flag's default (``set_defaults(verbose=False)``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # SUPPRESS: a command's parser sets it only when given, so it cannot undo a -v given before it.
        self.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                          help="log at INFO and show tracebacks")

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def table_width(piped: int) -> int | None:
    """The width for a rich ``Console``: the terminal's (``None``: rich asks it, and honours
    ``COLUMNS``) on a terminal or when ``COLUMNS`` is set, else ``piped`` (a file or a pipe)."""
    return None if sys.stdout.isatty() or os.environ.get("COLUMNS") else piped

"""ckplan's log: what the planner says while training runs (a new shape group planned, the plan a callback
made), one line each on stderr prefixed ``ckplan:``.

The ``ckplan`` logger has a handler of its own at INFO and does not pass its records to the root logger (as
transformers' does): the lines show without any logging setup, and once only under one.
``logging.getLogger("ckplan").setLevel(logging.WARNING)`` silences them; attaching a handler of your own and
setting ``propagate`` sends them where you like.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

ROOT = "ckplan"


class _Stderr(logging.StreamHandler):
    """A handler writing to whatever ``sys.stderr`` is when a line is logged (pytest's and notebooks' captures
    replace it after import)."""

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:  # StreamHandler.__init__ sets it
        pass


def _root() -> logging.Logger:
    root = logging.getLogger(ROOT)
    if not any(isinstance(h, _Stderr) for h in root.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("ckplan: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False
    return root


def get_logger(name: str) -> logging.Logger:
    """The logger of one part of the planner (``ckplan.<name>``), under the ``ckplan`` logger and its handler."""
    _root()
    return logging.getLogger(f"{ROOT}.{name}")

"""Context managers combined (torch-free)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def entered(*contexts: Any) -> Iterator[None]:
    """Enters the given context managers in order (outermost first), as one."""
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context)
        yield

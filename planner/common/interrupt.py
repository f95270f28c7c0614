"""Ctrl-C that is never lost (torch-free).

Python raises KeyboardInterrupt in whatever Python code runs next after SIGINT arrives. When that code is a
callback the interpreter runs from C (a weakref callback during garbage collection: torch.compile keeps
weak-keyed tables whose callbacks run after each step the profile times), the exception is printed as
"Exception ignored" and dropped, and the step goes on as if Ctrl-C had not been pressed. ``kept_ctrl_c``
remembers each Ctrl-C while a block runs and raises KeyboardInterrupt when the block ends, if it was dropped.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType


@contextmanager
def kept_ctrl_c() -> Iterator[None]:
    """Runs the block with Ctrl-C remembered: it raises KeyboardInterrupt as ever and, if that exception was
    dropped inside a callback, again when the block ends. Only in the main thread with Python's own SIGINT
    handler installed; elsewhere (a worker thread, a handler of the user's or the OS default) it changes
    nothing."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    pressed = []

    def remember(signum: int, frame: FrameType | None) -> None:
        pressed.append(signum)
        signal.default_int_handler(signum, frame)

    signal.signal(signal.SIGINT, remember)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pressed:  # the block ended as if Ctrl-C had not been pressed: its KeyboardInterrupt was dropped
        raise KeyboardInterrupt

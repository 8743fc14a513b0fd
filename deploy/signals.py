"""Ctrl-C (SIGINT) and SIGTERM stop `pdserve up` at any moment of its start, not only once it serves.

`StopSignals` is installed first thing. A signal never raises into the code it interrupts: it
records that a stop was asked for and, while an asyncio task is attached (the workers' start,
the handshakes, the HTTP bind, serving), cancels that task from the event loop. Ray's own start
(`ray.init`, a few seconds of spawning its processes) is left to finish, because an exception
thrown into it can leave processes started and not yet recorded; the caller checks `requested`
right after and shuts that Ray down at once. `ray_keeps_our_handlers` stops `ray.init` from
putting its own SIGTERM handler (exit at once, status 1) in place of ours meanwhile. Every wait
stays bounded: Ray's start has its own timeout, the workers' start `start_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Callable, Iterator

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """on_signal(name, first): called in the main thread for every stop signal (first: the first one)."""

    def __init__(self, on_signal: Callable[[str, bool], None] | None = None):
        self.requested: str | None = None  # the first stop signal's name, once one came
        self._on_signal = on_signal
        self._saved: dict = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None

    def install(self) -> None:
        """Handle the stop signals here (again after `ray.init`: Ray's core worker puts its crash
        handler, which dumps a stack trace on SIGTERM, in front of ours)."""
        for sig in STOP_SIGNALS:
            previous = signal.signal(sig, self._handle)
            self._saved.setdefault(sig, previous)

    def restore(self) -> None:
        """The handlers there were before the first `install`."""
        for sig, previous in self._saved.items():
            signal.signal(sig, previous)
        self._saved.clear()

    def attach(self, task: asyncio.Task) -> None:
        """From now on a stop signal cancels `task` (at once when one already came)."""
        self._loop, self._task = task.get_loop(), task
        if self.requested is not None:
            task.cancel()

    def detach(self) -> None:
        self._loop = self._task = None

    def _handle(self, signum: int, frame) -> None:
        first = self.requested is None
        if first:
            self.requested = signal.Signals(signum).name
        if self._on_signal is not None:
            self._on_signal(signal.Signals(signum).name, first)
        loop, task = self._loop, self._task
        if task is not None and loop is not None and not loop.is_closed():
            # NOTE: a signal handler runs between two bytecodes of the main thread, possibly inside
            # the loop's own code: the cancel is queued through the loop's thread-safe door
            loop.call_soon_threadsafe(task.cancel)


@contextlib.contextmanager
def ray_keeps_our_handlers() -> Iterator[None]:
    """While inside, Ray's `set_sigterm_handler` (called by `ray.init` and by the local node it
    starts) leaves the handler in place. NOTE: Ray looks the function up on its module at each
    call, so replacing the module's attribute is enough; Ray's atexit hook still stops what it
    started if this process exits."""
    from ray._private import utils

    saved = utils.set_sigterm_handler
    utils.set_sigterm_handler = _leave_handler
    try:
        yield
    finally:
        utils.set_sigterm_handler = saved


def _leave_handler(handler) -> None:
    """Ray's handler, not installed."""

"""Ctrl-C (SIGINT) and SIGTERM stop `pdserve up` at any moment of its start, not only once it serves.

`StopSignals` is installed first thing. A signal never raises into the code it interrupts: it
records that a stop was asked for and, while an asyncio task is attached (the workers' start,
the handshakes, the HTTP bind, serving), cancels that task from the event loop. Ray's own start
(`ray.init`, a few seconds of spawning its processes) is left to finish, because an exception
thrown into it can leave processes started and not yet recorded; the caller checks `requested`
right after and shuts that Ray down at once. Every wait stays bounded: Ray's start has its own
timeout, the workers' start `start_timeout_s`.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

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
        """Handle the stop signals here (again: `ray.init` replaces the SIGTERM handler)."""
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

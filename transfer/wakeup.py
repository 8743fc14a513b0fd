"""A wake-up pipe for a receiver's poll: `set()` from any thread makes the owner's poll return,
so a decode worker's loop waits on its KV receiver alone and still takes a queued command (or a
Ray channel call) at once, with no polling in slices. `fd` is what the poll waits on; `clear()`
empties it. Setting an already set pipe is a no-op (a full pipe is as good as one byte)."""

from __future__ import annotations

import contextlib
import os


class Wakeup:
    def __init__(self):
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._w, False)

    def set(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._w, b"!")

    def clear(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self.fd, 4096):
                pass

    def close(self) -> None:
        for fd in (self.fd, self._w):
            with contextlib.suppress(OSError):
                os.close(fd)

"""How long one thread has waited for a CPU: the run-queue time Linux keeps per thread
(/proc/self/task/TID/schedstat, its second field, in nanoseconds). The engine loop subtracts it
from an iteration's length (runtime.loop.WorkerLoop.progress), so a worker whose process is starved
of CPU by others on its node (Ray runs its workers niced, below the processes around them) is not
called wedged: its loop is runnable, not stuck. Reading it is one pread on a file kept open (about
1 us). Where the file does not exist (not Linux, no schedstats), the wait reads 0 and an iteration's
length is its wall time, as before.
"""

from __future__ import annotations

import os
import threading


class ThreadWait:
    """The calling thread's run-queue wait; `seconds()` may be read from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # a read never uses a descriptor that close() has released
        try:
            self._fd: int | None = os.open(f"/proc/self/task/{threading.get_native_id()}/schedstat",
                                           os.O_RDONLY)
        except OSError:
            self._fd = None

    def seconds(self) -> float:
        """Seconds this thread has spent runnable but waiting for a CPU (0.0 where unknown)."""
        with self._lock:
            if self._fd is None:
                return 0.0
            try:
                data = os.pread(self._fd, 128, 0)
            except OSError:
                return 0.0
        try:
            return int(data.split()[1]) / 1e9
        except (IndexError, ValueError):
            return 0.0

    def close(self) -> None:
        """Release the file; a read in progress on another thread (a heartbeat) finishes first."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

"""A worker's heartbeat: a thread of its own, apart from the engine loop, that tells the
coordinator every period that the process is alive and how far its loop is.

The engine loop reports between steps, and one step can take seconds (a long prefill on a
one-thread CPU worker). Were the loop's reports the heartbeat, such a step would read as a dead
worker. This thread sends a `protocol.messages.Heartbeat` over its own push socket (ZeroMQ
sockets are not shared between threads) with `WorkerLoop.progress()`: how long the current loop
iteration has run, the tokens of the step in progress and what that step should take at the
measured step rate. The coordinator (coordinator.workers.WorkerState.wedged) calls the worker
busy while that explains the wait, wedged past it, and dead when the heartbeats stop.
"""

from __future__ import annotations

import logging
import threading

from protocol.messages import Heartbeat
from protocol.queues import PushQueue

log = logging.getLogger(__name__)


class HeartbeatThread:
    """Sends `Heartbeat(name, **progress())` to `address` every `period_s` until `stop()`."""

    def __init__(self, name: str, address: str, period_s: float, progress, keys=None):
        self.name, self.period_s, self.progress = name, period_s, progress
        self._queue = PushQueue(address, keys=keys, send_timeout_s=max(1.0, 5 * period_s))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.period_s):
                self._queue.put(Heartbeat(self.name, **self.progress()))
        except Exception:  # never silently: without heartbeats the coordinator replaces this worker
            log.exception("%s: heartbeat thread failed", self.name)
        finally:
            self._queue.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5 * self.period_s + 5.0)

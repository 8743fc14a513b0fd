"""An in-process worker actor body (no Ray) with a real ZeroMQ PULL socket standing in for the
coordinator: `in_process(WorkerClass, config)` yields the worker and a `Reports` reader that
collects its `WorkerReport`s (events and the latest stats) and `Heartbeat`s until a condition
holds, bounded."""

from __future__ import annotations

import contextlib
import time

import zmq

from protocol.codec import decode
from protocol.messages import Heartbeat


class Reports:
    def __init__(self, pull):
        self.pull, self.events, self.stats, self.heartbeats = pull, [], {}, []

    def until(self, condition, deadline_s: float = 20.0) -> list:
        """Read reports until condition() holds (AssertionError with what was seen if it never does)."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end and not condition():
            if self.pull.poll(100):
                report = decode(self.pull.recv())
                if isinstance(report, Heartbeat):  # from the worker's heartbeat thread
                    self.heartbeats.append(report)
                    continue
                self.events.extend(report.events)
                self.stats.update(report.stats)
        assert condition(), (self.events, self.stats)
        return self.events


@contextlib.contextmanager
def in_process(worker_class, config: dict):
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    address = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    worker = worker_class({**config, "events_address": address})
    try:
        yield worker, Reports(pull)
    finally:
        worker.shutdown()
        pull.close(0)
        ctx.term()

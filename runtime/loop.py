"""The one engine loop every worker role runs: a thread, a command queue, periodic reports, stats
snapshots, fault hooks and shutdown. Liveness is not the loop's job: a separate heartbeat thread
(runtime.heartbeat) reads `progress()`, so a long engine step never looks like a dead worker.

The loop thread owns the engine (every engine and pool call happens on it). Each iteration it
lets the role handler wait for work (by default: on the command queue; the decode role polls its
KV receiver instead), dispatches queued commands to the handler, steps the engine when it has
work and reports that step's events at once, lets the handler do its per-iteration work
(migrations), and reports again when that made events or a heartbeat is due; every report
carries a fresh stats snapshot and the blocks held per request.

A role handler is a small object with:
  engine                               the LLMEngine the loop steps
  handle(command, events) -> reply     a queued command, on the loop thread (isinstance dispatch)
  wait(loop, timeout, events)          optional: wait for work up to `timeout` (default: commands)
  wake()                               optional, any thread: end a `wait` now (a command was queued)
  on_step(outputs, events)             the engine's outputs of one step
  after_step(events)                   optional: per-iteration work (migrations, expiries)
  stats() -> dict                      role-specific counters, merged into the snapshot
  holdings() -> dict[str, int]         blocks held per request (see WorkerReport)
  close()                              optional: release sockets at loop exit
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass

from runtime.cpu_wait import ThreadWait

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopConfig:
    name: str                    # the worker's id
    heartbeat_s: float = 0.2     # a report goes out at least this often, events or not
    idle_poll_s: float = 0.02    # how long an idle loop waits for work at a time
    busy_poll_s: float = 0.001   # how long a loop with engine work waits for commands (or KV) between steps
    call_timeout_s: float = 30.0  # bound on a caller's wait for the loop (a reply, the join at shutdown)


class _Call:
    """A queued command whose caller waits for the reply."""

    def __init__(self, command):
        self.command = command
        self.future: concurrent.futures.Future = concurrent.futures.Future()


class _Hang:
    """Fault hook: wedge the loop thread until shutdown."""


class WorkerLoop:
    """Runs `handler` on a thread; `emit(events, stats, holdings)` receives each report."""

    def __init__(self, config: LoopConfig, handler, emit):
        self.config, self.handler, self.emit = config, handler, emit
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = getattr(handler, "wake", None)  # ends the handler's `wait` (any thread)
        self._stop = threading.Event()
        self.failed: str | None = None
        self._last_emit = 0.0
        self._iteration = (time.monotonic(), 0.0)  # (start, CPU wait then): read by progress()
        self._cpu_wait: ThreadWait | None = None   # the loop thread's run-queue wait (runtime.cpu_wait)
        self._stats = self._snapshot()
        self._thread = threading.Thread(target=self._run, name=f"{config.name}-loop", daemon=True)
        self._thread.start()

    # ---- any thread -----------------------------------------------------------------------------
    def send(self, command) -> None:
        """Queue a command for the loop; no reply."""
        self._put(command)

    def call(self, command):
        """Queue a command and wait (bounded) for the handler's reply; its exception is raised here."""
        call = _Call(command)
        self._put(call)
        return call.future.result(timeout=self.config.call_timeout_s)

    def _put(self, item) -> None:
        self._commands.put(item)
        if self._wake is not None:  # the loop may be waiting in the handler's `wait`: end it now
            self._wake()

    def stats(self) -> dict:
        """The last snapshot (taken on the loop thread after every iteration)."""
        return dict(self._stats)

    def hang(self) -> None:
        self._put(_Hang())

    def alive(self) -> bool:
        return self._thread.is_alive() and self.failed is None

    def progress(self) -> dict:
        """How far the loop is, read from any thread (the fields of protocol.messages.Heartbeat).
        busy_s: how long the current iteration has run, less the time the loop thread waited for a
        CPU meanwhile (starved by other processes, it is slow, not stuck)."""
        engine = self.handler.engine
        step = engine.current_step  # (start, tokens) of the forward in progress, or None
        tokens = step[1] if step else 0
        expected = engine.scheduler.pacer.expected_s(tokens) if tokens else None
        start, waited = self._iteration
        wait = self._cpu_wait
        starved = wait.seconds() - waited if wait is not None else 0.0
        return {"loop_alive": self.alive(), "busy_s": max(0.0, time.monotonic() - start - starved),
                "step_tokens": tokens, "step_expected_s": expected or 0.0}

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(self.config.call_timeout_s)

    # ---- the loop thread ------------------------------------------------------------------------
    def drain(self, events: list, timeout: float | None = None) -> None:
        """Dispatch queued commands; with `timeout`, first wait up to that long for one."""
        while True:
            try:
                item = self._commands.get(timeout=timeout) if timeout else self._commands.get_nowait()
            except queue.Empty:
                return
            timeout = None
            if isinstance(item, _Hang):
                self._stop.wait()
                return
            call = item if isinstance(item, _Call) else None
            try:
                reply = self.handler.handle(call.command if call else item, events)
            except Exception as e:
                if call is None:
                    raise  # a fire-and-forget command broke the handler: fail loudly
                call.future.set_exception(e)
                continue
            if call is not None:
                call.future.set_result(reply)

    def _run(self) -> None:
        handler, cfg = self.handler, self.config
        wait = getattr(handler, "wait", None)
        after = getattr(handler, "after_step", None)
        wait_clock = self._cpu_wait = ThreadWait()
        try:
            while not self._stop.is_set():
                self._iteration = (time.monotonic(), wait_clock.seconds())
                events: list = []
                busy = handler.engine.has_work()
                if wait is not None:  # e.g. the decode role's KV receiver
                    wait(self, cfg.busy_poll_s if busy else cfg.idle_poll_s, events)
                else:  # NOTE: with engine work, take what is queued and step at once (no wait)
                    self.drain(events, None if busy else cfg.idle_poll_s)
                if self._stop.is_set():
                    break
                if handler.engine.has_work():
                    handler.on_step(handler.engine.step(), events)
                if events and after is not None:
                    self._report(events)  # NOTE: tokens leave before after_step's slow work (migrations)
                    events = []
                if after is not None:
                    after(events)
                if events or time.monotonic() - self._last_emit > cfg.heartbeat_s:
                    self._report(events)
                else:
                    self._stats = self._snapshot()
        except Exception as e:  # fail loudly: one last report says so, then the reports stop
            log.exception("%s: loop failed", cfg.name)
            self.failed = f"{type(e).__name__}: {e}"
            self._stats = {**self._stats, "failed": self.failed}
            try:
                self.emit([], self._stats, handler.holdings())
            except Exception:  # the report is a courtesy; the missing heartbeat says it too
                log.exception("%s: final report failed", cfg.name)
        finally:
            self._cpu_wait = None
            wait_clock.close()
            close = getattr(self.handler, "close", None)
            if close is not None:
                close()

    def _report(self, events: list) -> None:
        self._stats = self._snapshot()
        self.emit(events, self._stats, self.handler.holdings())
        self._last_emit = time.monotonic()

    def _snapshot(self) -> dict:
        e = self.handler.engine
        return {"name": self.config.name, "role": e.config.role, "block_size": e.config.block_size,
                **e.kv.usage(), "queue_depth": len(e.scheduler.waiting), "running": len(e.scheduler.running),
                "swapped": len(e.scheduler.swapped), "preemptions": e.scheduler.preemptions,
                "active_requests": len(e.requests), "steps": e.steps, "failed": self.failed,
                **e.scheduler.pacer.summary(), **self.handler.stats()}

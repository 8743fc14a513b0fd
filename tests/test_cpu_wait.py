"""runtime.cpu_wait: a thread that shares one core with a busy process is seen waiting for it (the
time the engine loop's liveness no longer counts as stuck), and without the schedstat file the wait
reads 0."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from runtime.cpu_wait import ThreadWait

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/thread-self/schedstat") or os.cpu_count() < 2,
                                reason="needs Linux schedstats and two CPUs")

HOG = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end: pass\n"


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _waited_while_spinning(cpu: int, hog: bool) -> float:
    """Run-queue seconds of this thread while it spins 0.8 s pinned to `cpu` (beside a busy process
    pinned to the same CPU when `hog`)."""
    before = os.sched_getaffinity(0)
    proc = None
    try:
        os.sched_setaffinity(0, {cpu})  # this thread only (Linux: 0 is the calling thread)
        if hog:
            proc = subprocess.Popen([sys.executable, "-c", HOG.format(s=3.0)],
                                    preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
            time.sleep(0.3)  # the hog is running
        clock = ThreadWait()
        start = clock.seconds()
        _spin(0.8)
        waited = clock.seconds() - start
        clock.close()
        return waited
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        os.sched_setaffinity(0, before)


def test_a_thread_sharing_its_core_with_a_busy_process_is_seen_waiting():
    cpu = min(os.sched_getaffinity(0))
    shared = _waited_while_spinning(cpu, hog=True)
    assert shared > 0.2, shared  # the fair scheduler gives each about half of the 0.8 s


def test_without_the_schedstat_file_the_wait_reads_zero(monkeypatch):
    def refuse(*args, **kwargs):
        raise FileNotFoundError("no schedstat here")

    monkeypatch.setattr(os, "open", refuse)
    clock = ThreadWait()
    _spin(0.05)
    assert clock.seconds() == 0.0
    clock.close()


def test_close_waits_for_a_read_in_progress(monkeypatch):
    """A heartbeat may read the wait while the loop thread closes the clock at exit: close() must
    not release the descriptor under the read (the number could be reused by another open)."""
    import threading

    import runtime.cpu_wait as cw

    entered, release = threading.Event(), threading.Event()
    real = os.pread

    def slow_pread(fd, n, offset):
        entered.set()
        assert release.wait(10)
        os.fstat(fd)  # still open: OSError here would mean close() ran under the read
        return real(fd, n, offset)

    clock = ThreadWait()
    monkeypatch.setattr(cw.os, "pread", slow_pread)
    got = []
    reader = threading.Thread(target=lambda: got.append(clock.seconds()))
    reader.start()
    assert entered.wait(10)
    closer = threading.Thread(target=clock.close)
    closer.start()
    closer.join(0.1)
    assert closer.is_alive()  # held until the read is done
    release.set()
    reader.join(10)
    closer.join(10)
    assert not closer.is_alive() and len(got) == 1 and got[0] >= 0.0
    assert clock.seconds() == 0.0  # closed: reads 0

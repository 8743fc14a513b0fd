"""Processes of one test's run, found by a marker in their environment ("NAME=VALUE"): a process
inherits its parent's environment, so every process a run starts carries it (Ray's GCS, raylet,
agents and workers included, whose command lines Ray rewrites). Lets a test check that nothing
of its run is left, and end exactly what it started (never `ray stop`: that stops every Ray of the
user on the machine)."""

from __future__ import annotations

import os
import signal
import time


def marked(marker: str) -> list[int]:
    """Ids of the live processes whose environment holds `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker.encode() in f.read().split(b"\0"):
                    found.append(int(pid))
        except OSError:  # gone meanwhile, or not ours
            pass
    return found


def kill_marked(marker: str, timeout: float = 30.0) -> list[int]:
    """SIGKILL every process holding `marker` until none is left (bounded); those still left."""
    deadline = time.monotonic() + timeout
    while (left := marked(marker)) and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    return marked(marker)

"""Commands and processes for the namespaced-node harness (tests/netns_nodes.py): whether it can
run here (`unavailable`), one bounded command (`sh`), a process and its descendants (`tree`, from
/proc), ending exactly the pids given (`kill`: SIGTERM, then SIGKILL after a bound), never by
name, and a port for the Ray head (`free_port`). Test and bench code only.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

RAY = os.path.join(os.path.dirname(sys.executable), "ray")


class HarnessError(RuntimeError):
    """A step of building or driving the namespaced nodes failed (the command and its output)."""


def unavailable() -> str | None:
    """Why the harness cannot run on this machine, or None."""
    if os.geteuid() != 0:
        return "namespaced Ray nodes need root (ip netns, veth, mount namespaces)"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"namespaced Ray nodes need `{tool}`, which is not on PATH"
    if not os.path.exists(RAY):
        return f"no `ray` command next to {sys.executable}"
    return None


def sh(*cmd: str, timeout: float = 20.0, check: bool = True) -> str:
    """Run one command (bounded); HarnessError with its output when it fails and `check`."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise HarnessError(f"{' '.join(cmd)}: no answer within {timeout:g}s") from None
    if check and out.returncode != 0:
        why = out.stderr.strip() or out.stdout.strip()
        raise HarnessError(f"{' '.join(cmd)}: exit {out.returncode}: {why}")
    return out.stdout


def children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            out.setdefault(ppid, []).append(int(entry))
    return out


def tree(pid: int) -> list[int]:
    """`pid` and all its descendants."""
    kids, out, todo = children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def kill(pids, deadline_s: float = 3.0) -> None:
    """SIGTERM, then SIGKILL what is left after `deadline_s`: only the pids given (ours)."""
    pids = set(pids)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + deadline_s
        while time.monotonic() < end and any(os.path.exists(f"/proc/{p}") for p in pids):
            time.sleep(0.05)
        pids = {p for p in pids if os.path.exists(f"/proc/{p}")}
        if not pids:
            return


def restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def free_port() -> int:
    """A port free on every address now, outside the kernel's ephemeral range (so no outgoing
    connection of another process takes it before Ray binds it; only another explicit choice
    still could) and above Ray's worker ports (10002-19999 by default, which Ray refuses to
    share): between them when there is room, else above the ephemeral range."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = map(int, f.read().split())
    first, last = (20000, low) if low > 21000 else (high + 1, 65536)
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(first, last)
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
                return port
            except OSError:
                continue
    raise HarnessError(f"no free port in {first}..{last - 1}")

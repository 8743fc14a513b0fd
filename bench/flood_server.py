"""Starting and stopping `pdserve up` for the flood check (see bench.flood): `Up` runs the
console script beside this interpreter (or `python -m pdserve_cli.main` when there is none) as a
subprocess in its own session, waits for it to print its address and exposes it as `url`, keeps
draining its output, and `stop` shuts it down with SIGTERM and then kills whatever of its process
group is left. Re-exported by bench.flood, where callers import it.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import threading
import time


class Up:
    """`pdserve up ...` as a subprocess in its own session; `url` once it printed its address."""

    def __init__(self, args: list[str], start_timeout_s: float = 180.0, env: dict | None = None):
        exe = os.path.join(os.path.dirname(sys.executable), "pdserve")
        cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "pdserve_cli.main"]
        self.cmd = cmd + ["up", *args]
        self.output = ""
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={"OMP_NUM_THREADS": "1", **os.environ, **(env or {})},
                                     start_new_session=True)
        self.url = ""
        try:
            deadline, m = time.monotonic() + start_timeout_s, None
            while m is None and time.monotonic() < deadline and self.proc.poll() is None:
                # all that arrived, not one line: lines left in a reader buffer are invisible to select
                if select.select([self.proc.stdout], [], [], 1.0)[0]:
                    self.output += os.read(self.proc.stdout.fileno(), 1 << 16).decode(errors="replace")
                    m = re.search(r"on (http://[\d.]+:\d+)/v1", self.output)
            if m is None:
                raise RuntimeError(f"pdserve up did not come up:\n{self.output}")
            self.url = m.group(1)
            self._drain = threading.Thread(target=self._read, daemon=True)
            self._drain.start()
        except BaseException:
            self.stop()
            raise

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.output += line

    def stop(self, timeout: float = 90.0) -> int | None:
        """SIGTERM (pdserve up shuts down its Ray and actors), then SIGKILL of the group if needed."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever of its process group is left (raylet, workers)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                os.killpg(self.proc.pid, 0)
                time.sleep(0.3)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        return self.proc.returncode

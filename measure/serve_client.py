"""The serving benchmark's load client, in a process of its own, so that the client's event loop
never shares a GIL with the coordinator it measures (the coordinator runs in the bench's
process, on `deploy.launch.ClusterServer`'s thread).

`load_in_subprocess` starts `python -m measure.serve_client`, writes the job to its stdin as one
JSON document (url, timeout, sequential, the request specs), and reads JSON lines back from its
stdout: one `{"record": ...}` per request as it ends (so the parent can show progress), then
`{"end": {"duration_s", "pid", "count"}}`. Nothing crosses the boundary but JSON. The child runs
`measure.loadgen.run_load` and exits; the parent kills it if it outlives every request's timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path

from measure.loadgen import RequestRecord, RequestSpec

ROOT = Path(__file__).resolve().parents[1]


def load_in_subprocess(url: str, specs: list[RequestSpec], timeout_s: float, sequential: bool = False,
                       progress=None) -> tuple[list[RequestRecord], float, int]:
    """Run `specs` against `url` from a child process; returns (records in spec order, the run's
    duration in s, the child's pid). `progress(record)` is called here as each record arrives."""
    if len({s.index for s in specs}) != len(specs):
        raise ValueError("request specs need distinct indices (records are matched back by index)")
    job = {"url": url, "timeout_s": timeout_s, "sequential": sequential, "specs": [asdict(s) for s in specs]}
    last = max((s.arrival_s for s in specs), default=0.0)
    bound = 60.0 + (len(specs) * timeout_s if sequential else last + timeout_s)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.Popen([sys.executable, "-m", "measure.serve_client"], cwd=ROOT, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    watchdog = threading.Timer(bound, proc.kill)
    watchdog.daemon = True
    watchdog.start()
    records: dict[int, RequestRecord] = {}
    end = None
    try:
        proc.stdin.write(json.dumps(job))
        proc.stdin.close()
        for line in proc.stdout:
            msg = json.loads(line)
            if "record" in msg:
                rec = RequestRecord(**msg["record"])
                records[rec.index] = rec
                if progress is not None:
                    progress(rec)
            elif "end" in msg:
                end = msg["end"]
        rc = proc.wait()
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if end is None or rc != 0 or len(records) != len(specs):
        raise RuntimeError(f"load client (pid {proc.pid}) exited {rc} with {len(records)}/{len(specs)} "
                           f"records{' (killed after ' + format(bound, '.0f') + ' s)' if rc == -9 else ''}")
    return [records[s.index] for s in specs], float(end["duration_s"]), int(end["pid"])


def main() -> int:
    import asyncio

    from measure.loadgen import run_load

    job = json.load(sys.stdin)
    specs = [RequestSpec(**s) for s in job["specs"]]
    out = sys.stdout
    lock = threading.Lock()

    def emit(msg: dict) -> None:
        with lock:
            out.write(json.dumps(msg, allow_nan=False) + "\n")
            out.flush()

    records, duration = asyncio.run(run_load(job["url"], specs, timeout_s=job["timeout_s"],
                                             sequential=job["sequential"],
                                             progress=lambda r: emit({"record": r.to_dict()})))
    emit({"end": {"duration_s": duration, "pid": os.getpid(), "count": len(records)}})
    return 0


if __name__ == "__main__":
    sys.exit(main())

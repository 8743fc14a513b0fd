"""The nixl baseline of the migration benchmark (see bench.baselines): NVIDIA's transfer library
(UCX backend), a WRITE from an initiator agent in this process into a target agent's registered
buffer in a spawned process, when the optional `nixl` package is importable; otherwise it reports
`{"gb_per_s": None, "note": "nixl not installed"}`. It is optional (not in the project's
requirements); on a CPU-only machine `pip install --no-deps nixl nixl-cu12` installs it and UCX
runs over host memory. `NixlBaseline` starts the target process and both agents once and
measures any number of payload sizes with them (a fresh registered buffer on each side per size):
creating a UCX agent costs about a second here, and the benchmark measures every size. The agents
are made as the nixl channel makes them (`transfer.channels.nixl_api._new_agent`): NIXL's own progress
thread spins a core per agent, which kept alive through the benchmark starved everything else. Timed per
WRITE from `transfer` to DONE (handles are prepared untimed, as nixl users do); after the repeats
the target's buffer is checked against the payload (xxh3), untimed; one word of the payload
changes before each repeat (untimed), so a WRITE that delivered nothing fails the check. `hashed=True`
(the `nixl_xxh3` row) times the integrity work every pdserve path does around the same WRITE: the
initiator hashes the payload before it and the target after DONE, each as pdserve's sender hashes
a manifest (`transfer.checksum.checksum_many`: 2 MiB chunks on 2 threads), and the target's digests
come back over the pipe to be compared (a round trip inside the timed region: negligible at
hundreds of MiB, not at the sub-MiB points). The hashing is serial with the WRITE: pdserve's
receiver also overlaps verifying one landed group with reading the next (`transfer.pull`), which
this baseline does not. The two
processes speak msgpack maps over a pipe (`send_bytes`: nothing pickled). Any failure is reported
as a note, never raised. `nixl(nbytes, repeats)` is one size with a baseline of its own.
Re-exported by bench.baselines.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time

import msgpack
import torch

from transfer.channels.nixl_api import _new_agent
from transfer.checksum import checksum_many

NIXL_INITIATOR, NIXL_TARGET = "pdserve-bench-initiator", "pdserve-bench-target"
WAIT_S = 120  # bound on every answer of the target process
CHUNK = 2 << 20  # bytes per hashed chunk


def _send(conn, **msg) -> None:
    conn.send_bytes(msgpack.packb(msg, use_bin_type=True))


def _recv(conn, what: str) -> dict:
    if not conn.poll(WAIT_S):
        raise RuntimeError(f"nixl target process: no {what} within {WAIT_S} s")
    msg = msgpack.unpackb(conn.recv_bytes(), raw=False)
    if msg.get("kind") == "error":
        raise RuntimeError(f"nixl target: {msg['error']}")
    if msg.get("kind") != what:
        raise RuntimeError(f"nixl target answered {msg.get('kind')!r}, expected {what!r}")
    return msg


def _nixl_target(conn) -> None:
    """The target process: serves "buffer" (register a fresh zeroed buffer of `nbytes`, load the
    initiator's metadata, answer its own metadata and the buffer's descriptors: UCX carries a
    registration's keys in the metadata, so both sides exchange it again per buffer), "digest" (of
    the current buffer) and "stop" requests until the pipe closes or stays silent 300 s."""
    try:
        from nixl import _api

        agent = _new_agent(_api, NIXL_TARGET)
        _send(conn, kind="ready")
        dst, reg, peer = None, None, None
        while conn.poll(300):
            msg = msgpack.unpackb(conn.recv_bytes(), raw=False)
            if msg.get("op") == "buffer":
                if reg is not None:
                    agent.deregister_memory(reg)
                if peer is not None:
                    agent.remove_remote_agent(peer)
                dst = torch.zeros(int(msg["nbytes"]), dtype=torch.uint8)
                reg = agent.register_memory(dst)
                peer = agent.add_remote_agent(msg["meta"])  # for the initiator's notifications
                _send(conn, kind="buffer", meta=agent.get_agent_metadata(),
                      descs=agent.get_serialized_descs(agent.get_xfer_descs(dst)))
            elif msg.get("op") == "digest":
                _send(conn, kind="digest", value=_digests(dst))
            else:
                return
    except Exception as e:
        _send(conn, kind="error", error=f"{type(e).__name__}: {e}"[:300])


def _digests(buf: torch.Tensor) -> list[int]:
    """xxh3 of each 2 MiB chunk of a uint8 tensor, on 2 threads (as a pdserve sender hashes)."""
    view = memoryview(buf.numpy())
    return checksum_many([[view[at:at + CHUNK]] for at in range(0, len(view), CHUNK)], threads=2)


class NixlBaseline:
    """One target process and one initiator agent, made at the first `measure`, kept until `close`."""

    def __init__(self) -> None:
        self.conn = self.proc = self.agent = self.remote_name = None
        self.failed: str | None = None  # why the first size failed (every later size reports it)

    def _start(self) -> None:
        from nixl import _api

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_nixl_target, args=(child,), daemon=True)
        self.proc.start()
        self.agent = _new_agent(_api, NIXL_INITIATOR)
        _recv(self.conn, "ready")

    def measure(self, nbytes: int, repeats: int = 5, hashed: bool = False) -> dict:
        """{"gb_per_s", "verified", "note"} or {"gb_per_s": None, "note": why}; never raises.
        hashed: both ends hash the payload, timed (see the module docstring)."""
        try:
            import nixl  # noqa: F401
        except ImportError:
            return {"gb_per_s": None, "note": "nixl not installed"}
        if self.failed:
            return {"gb_per_s": None, "note": self.failed}
        reg = None
        try:
            if self.agent is None:
                self._start()
            agent = self.agent
            src = torch.randint(1, 256, (nbytes,), dtype=torch.uint8)
            reg = agent.register_memory(src)
            _send(self.conn, op="buffer", nbytes=nbytes, meta=agent.get_agent_metadata())
            answer = _recv(self.conn, "buffer")
            if self.remote_name is not None:
                agent.remove_remote_agent(self.remote_name)
            self.remote_name = agent.add_remote_agent(answer["meta"])
            remote = agent.deserialize_descs(answer["descs"])
            local = agent.get_xfer_descs(src)
            times, words = [], src[: nbytes // 8 * 8].view(torch.int64)
            for i in range(1 + repeats):  # the first is an untimed warm-up (connection setup)
                if len(words):
                    words[i % len(words)] += 1  # a payload the target does not hold yet
                handle = agent.initialize_xfer("WRITE", local, remote, self.remote_name, f"x{i}".encode())
                t0 = time.perf_counter()
                if hashed:
                    want = _digests(src)  # the sender's hashing, timed
                state = agent.transfer(handle)
                deadline = time.monotonic() + 60
                while state != "DONE":
                    if state == "ERR" or time.monotonic() > deadline:
                        raise RuntimeError(f"nixl transfer state {state}")
                    state = agent.check_xfer_state(handle)
                if hashed:
                    _send(self.conn, op="digest")
                    if _recv(self.conn, "digest")["value"] != want:
                        raise RuntimeError("nixl transfer did not deliver the bytes")
                if i > 0:
                    times.append(time.perf_counter() - t0)
                agent.release_xfer_handle(handle)
            if not hashed:  # untimed, once, the last repeat's payload (hashed: checked in every repeat)
                _send(self.conn, op="digest")
                if _recv(self.conn, "digest")["value"] != _digests(src):
                    raise RuntimeError("nixl transfer did not deliver the bytes")
            return {"gb_per_s": nbytes / statistics.median(times) / 1e9, "verified": True,
                    "note": "UCX, initiator and target agents in two processes"
                            + (", xxh3 on both ends (2 MiB chunks, 2 threads)" if hashed else "")}
        except Exception as e:  # an optional peer library: report, do not fail the benchmark
            note = f"nixl failed: {type(e).__name__}: {e}"[:300]
            if self.remote_name is None:  # it never worked: every later size says why
                self.failed = note
            return {"gb_per_s": None, "note": note}
        finally:
            if reg is not None:
                self.agent.deregister_memory(reg)

    def close(self) -> None:
        if self.conn is not None:
            try:
                _send(self.conn, op="stop")
            except OSError:
                pass
        if self.proc is not None:
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.terminate()
        self.conn = self.proc = self.agent = None


def nixl(nbytes: int, repeats: int = 5) -> dict:
    """One payload size on a baseline of its own (see NixlBaseline.measure)."""
    b = NixlBaseline()
    try:
        return b.measure(nbytes, repeats)
    finally:
        b.close()

"""transfer.channels.nixl_pool: the install hint without nixl, and NIXL READs between two agents in one
process and across two processes (skipped without nixl): bit-exact scattered reads, bounds refused
before anything is issued, bounded metadata, the timeout and error paths (handle released, peer
forgotten, ranges tainted), and a real timeout against a stopped peer that close() fences. (Region
and segment planning: test_nixl_segments.py.)"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import signal
import sys
import time

import msgpack
import numpy as np
import pytest
import torch
import xxhash

from transfer.channels import nixl_pool
from transfer.channels.nixl_pool import NixlAgent, NixlUnavailable, Region
from transfer.errors import LimitExceeded, MalformedMessage, TransferTimeout, TransportClosed

needs_nixl = pytest.mark.skipif(not nixl_pool.available(), reason="nixl not installed")
_names = itertools.count()


def _name(role: str) -> str:
    return f"test-nixl-{role}-{os.getpid()}-{next(_names)}"


# -- without nixl ------------------------------------------------------------------------------------


def test_unavailable_raises_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl", None)  # `import nixl` now raises ImportError
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    assert nixl_pool.available() is False
    with pytest.raises(NixlUnavailable) as info:
        NixlAgent("x")
    assert "pip install 'pdserve[nixl]'" in str(info.value)
    assert "pip install --no-deps nixl nixl-cu12" in str(info.value)


@pytest.fixture
def pair():
    """(reader, its 1 MiB destination tensor and Region, source agent, source tensor and Region,
    peer name): random bytes on both sides."""
    reader, source = NixlAgent(_name("reader")), NixlAgent(_name("source"))
    try:
        g = torch.Generator().manual_seed(1)
        src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g)
        dst = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g)
        src_region, dst_region = source.register(src), reader.register(dst)
        peer = reader.connect(source.metadata())
        yield reader, dst, dst_region, source, src, src_region, peer
    finally:
        reader.close()
        source.close()


SCATTERED = [(4096, 0, 4096), (8192, 4096, 4096), (12288, 8192, 1000),  # coalesce into one
             (900_000, 500_000, 65536), (1, 200_001, 4095), (0, (1 << 20) - 17, 17), (700_000, 300_000, 100)]


def _expected(dst, src, segs):
    out = dst.clone()
    for r, lo, n in segs:
        out[lo:lo + n] = src[r:r + n]
    return out


@needs_nixl
def test_read_scattered_bit_exact(pair):
    reader, dst, dst_region, _source, src, src_region, peer = pair
    expected = _expected(dst, src, SCATTERED)
    assert reader.read(peer, src_region, dst_region, SCATTERED, timeout_s=10) == sum(n for *_, n in SCATTERED)
    assert torch.equal(dst, expected)  # segments bit-exact, every other byte untouched
    again = [(r + 3, lo, n) for r, lo, n in SCATTERED if r + 3 + n <= src.numel()]
    expected = _expected(dst, src, again)
    assert reader.read(peer, src_region, dst_region, np.array(again, dtype=np.int64), timeout_s=10) > 0
    assert torch.equal(dst, expected)
    assert reader.read(peer, src_region, dst_region, [], timeout_s=10) == 0


@needs_nixl
@pytest.mark.parametrize("bad", [
    ((1 << 20) - 100, 0, 101),  # remote one byte past the end
    (0, (1 << 20) - 100, 101),  # local one byte past the end
    (-1, 0, 8), (0, 0, 0),
    (8, 10, 8),  # overlaps the good segment's local range
])
def test_out_of_bounds_refused_nothing_written(pair, bad):
    reader, dst, dst_region, _source, _src, src_region, peer = pair
    before = dst.clone()
    with pytest.raises(MalformedMessage):
        reader.read(peer, src_region, dst_region, [(0, 0, 4096), bad], timeout_s=10)
    assert torch.equal(dst, before)
    assert reader.tainted == () and reader.peers == (peer,)


@needs_nixl
def test_region_larger_than_registered_refused(pair):
    reader, dst, dst_region, _source, _src, src_region, peer = pair
    lying = Region.from_wire({**src_region.to_wire(), "nbytes": src_region.nbytes * 2})
    before = dst.clone()
    with pytest.raises(MalformedMessage):  # within the claimed region, outside the registration: nixl refuses
        reader.read(peer, lying, dst_region, [(0, 0, 4096), (src_region.nbytes, 4096, 4096)], timeout_s=10)
    assert torch.equal(dst, before)


@needs_nixl
def test_connect_bounds_and_idempotence(pair):
    reader, dst, dst_region, source, _src, src_region, peer = pair
    md = source.metadata()
    assert 0 < len(md) < 4096  # about 0.3 KiB plus about 0.1 KiB per registered region
    assert reader.connect(md) == peer and reader.peers == (peer,)
    with pytest.raises(LimitExceeded):
        reader.connect(md + b"\0" * (nixl_pool.MAX_METADATA_BYTES + 1 - len(md)))
    for junk in (b"", b"garbage", reader.metadata(), "text"):
        with pytest.raises(MalformedMessage):
            reader.connect(junk)
    reader.forget(peer)
    reader.forget(peer)  # idempotent
    with pytest.raises(TransportClosed):
        reader.read(peer, src_region, dst_region, [(0, 0, 8)], timeout_s=10)
    assert reader.connect(md) == peer  # the same metadata loads again after forget()
    assert reader.read(peer, src_region, dst_region, [(0, 0, 8)], timeout_s=10) == 8


@needs_nixl
def test_register_and_read_arguments(pair):
    reader, dst, dst_region, _source, _src, src_region, peer = pair
    assert reader.register(dst) == dst_region  # idempotent
    with pytest.raises(ValueError):
        reader.register(torch.zeros(4, 4).t())
    with pytest.raises(ValueError):
        reader.register(torch.zeros(0))
    with pytest.raises(ValueError):  # local must be one of this agent's registrations
        reader.read(peer, src_region, src_region, [(0, 0, 8)], timeout_s=10)
    for timeout in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            reader.read(peer, src_region, dst_region, [(0, 0, 8)], timeout_s=timeout)


@needs_nixl
@pytest.mark.parametrize("outcome", ["PROC", "ERR", "raise"])
def test_timeout_and_error_release_forget_taint(pair, monkeypatch, outcome):
    reader, dst, dst_region, _source, _src, src_region, peer = pair
    inner = reader._agent
    released = []
    real_release = inner.release_xfer_handle
    monkeypatch.setattr(inner, "release_xfer_handle", lambda h: (released.append(h), real_release(h)))

    def post(handle, notif_msg=b""):
        if outcome == "raise":
            raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT")
        return "PROC"

    monkeypatch.setattr(inner, "transfer", post)
    monkeypatch.setattr(inner, "check_xfer_state", lambda h: outcome if outcome != "raise" else "DONE")
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout if outcome == "PROC" else TransportClosed) as info:
        reader.read(peer, src_region, dst_region, SCATTERED, timeout_s=0.05)
    assert time.monotonic() - t0 < 2
    assert len(released) == 1 and released[0]._released
    ranges = ((0, 9192), (500_000, 65536), (200_001, 4095), ((1 << 20) - 17, 17), (300_000, 100))
    assert info.value.tainted == ranges
    assert reader.tainted == tuple((dst_region, o, n) for o, n in ranges)
    assert reader.peers == ()  # forgotten: a fresh handshake must connect it again
    reader.close()
    assert reader.tainted == ()


@needs_nixl
def test_close_idempotent_and_final(pair):
    reader, dst, dst_region, source, _src, src_region, peer = pair
    reader.close()
    reader.close()
    assert reader.closed
    for call in (lambda: reader.read(peer, src_region, dst_region, [(0, 0, 8)], 1), reader.metadata,
                 lambda: reader.connect(source.metadata()), lambda: reader.register(dst)):
        with pytest.raises(TransportClosed):
            call()
    reader.forget(peer)  # a no-op after close(), as for an unknown peer


# -- two processes -----------------------------------------------------------------------------------


def _serve_region(conn, name: str, nbytes: int, seed: int) -> None:
    """Child process: register `nbytes` of seeded random bytes, send msgpack {metadata, region, digest}
    as plain bytes, then wait for any message (or 60 s) and close."""
    agent = NixlAgent(name)
    g = torch.Generator().manual_seed(seed)
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    region = agent.register(buf)
    conn.send_bytes(msgpack.packb({"md": agent.metadata(), "region": region.to_wire(),
                                   "digest": xxhash.xxh3_64_intdigest(buf.numpy())}))
    conn.poll(60)
    agent.close()


class _Child:
    """A spawned _serve_region process and its hello; always terminated on exit."""

    def __init__(self, nbytes: int, seed: int = 7):
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_serve_region, args=(child_conn, _name("child"), nbytes, seed),
                                daemon=True)
        self.nbytes = nbytes

    def __enter__(self):
        self.proc.start()
        if not self.conn.poll(60):
            raise RuntimeError("nixl child did not start")
        hello = msgpack.unpackb(self.conn.recv_bytes(1 << 20))
        self.metadata, self.digest = hello["md"], hello["digest"]
        self.region = Region.from_wire(hello["region"], max_bytes=self.nbytes)
        return self

    def __exit__(self, *exc):
        try:
            os.kill(self.proc.pid, signal.SIGCONT)
        except (OSError, TypeError):
            pass
        self.proc.terminate()
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


@needs_nixl
def test_two_processes_read_8mib_digest():
    nbytes, block = 8 << 20, 256 << 10
    with _Child(nbytes) as child, NixlAgent(_name("parent")) as agent:
        dst = torch.zeros(nbytes, dtype=torch.uint8)
        local = agent.register(dst)
        peer = agent.connect(child.metadata)
        segs = [(i * block, i * block, block) for i in reversed(range(nbytes // block))]  # not coalescable
        assert agent.read(peer, child.region, local, segs, timeout_s=30) == nbytes
        assert xxhash.xxh3_64_intdigest(dst.numpy()) == child.digest


def _wait_stopped(pid: int, timeout_s: float = 5.0) -> None:
    """Until every thread of `pid` is in state T (stopped), per /proc."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that just exited
                pass
        if states and all(s == "T" for s in states):
            return
        time.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop")


@needs_nixl
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs SIGSTOP and /proc")
def test_stopped_peer_times_out_and_close_fences(monkeypatch):
    """Without CMA, UCX emulates the GET over TCP and needs the peer's progress: a stopped peer stalls
    the READ. The timeout releases the handle, which does not stop the GET (bytes would land once the
    peer resumes); close() destroys the worker, after which nothing lands."""
    monkeypatch.setenv("UCX_TLS", "^cma")  # read by UCX at agent creation, here and in the spawned child
    nbytes = 4 << 20
    with _Child(nbytes) as child:
        agent = NixlAgent(_name("parent"))
        try:
            dst = torch.zeros(nbytes, dtype=torch.uint8)
            local = agent.register(dst)
            peer = agent.connect(child.metadata)
            assert agent.read(peer, child.region, local, [(0, 0, 4096)], timeout_s=30) == 4096  # wired up
            dst.zero_()
            os.kill(child.proc.pid, signal.SIGSTOP)
            _wait_stopped(child.proc.pid)  # kill() returns before every thread has stopped
            t0 = time.monotonic()
            with pytest.raises(TransferTimeout) as info:
                agent.read(peer, child.region, local, [(0, 0, nbytes)], timeout_s=0.3)
            assert 0.3 <= time.monotonic() - t0 < 3
            assert info.value.tainted == ((0, nbytes),) and agent.peers == ()
            del info
        finally:
            agent.close()
        after_close = dst.clone()
        os.kill(child.proc.pid, signal.SIGCONT)
        time.sleep(0.5)  # the resumed peer answers the GET: nothing may land any more
        assert torch.equal(dst, after_close)
        assert int(dst.count_nonzero()) == 0  # nor did anything land while it was stopped

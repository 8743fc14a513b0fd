"""Issue 49, item 5: a NIXL migration on one node (a loopback KV address) leaves UCX listening on
loopback only, for the sender's agent (its pool registered for remote reads) and the receiver's;
UCX's default is every interface, the machine's routable address included. Observed from the
kernel's table of this process's listening TCP sockets (/proc/net/tcp*)."""

import os

import pytest
import torch

from kvcache.storage import KVLayout
from measure.pools import fill_random_sequence, make_manager
from tests.zmq_helpers import SHAPE, Served
from transfer import registry
from transfer.channels.nixl_api import ucx_net_devices
from transfer.channels.nixl_pool import available
from transfer.transport import TransportConfig

pytestmark = pytest.mark.skipif(not available(), reason="nixl is not installed (pip install 'pdserve[nixl]')")
LISTEN = "0A"  # /proc/net/tcp's state of a listening socket


def _listening() -> set[tuple[str, str]]:
    """(local address, port) in /proc/net/tcp's hex of every TCP socket this process listens on."""
    mine = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[len("socket:["):-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == LISTEN and fields[9] in mine:
                    found.add(tuple(fields[1].split(":")))
    return found


def _loopback(hex_address: str) -> bool:
    if len(hex_address) == 8:  # IPv4, little-endian: 127.x.x.x ends in 7F
        return hex_address.endswith("7F")
    return hex_address == "00000000000000000000000001000000"  # ::1


@pytest.mark.skipif("UCX_NET_DEVICES" in os.environ, reason="the operator's UCX_NET_DEVICES wins")
def test_a_single_node_migration_leaves_ucx_listening_on_loopback_only():
    assert ucx_net_devices("127.0.0.1") == "lo"
    src = make_manager(KVLayout(block_size=16, **SHAPE), 64)
    fill_random_sequence(src, "a", 70, torch.Generator().manual_seed(49))
    served = Served(make_manager(KVLayout(block_size=16, **SHAPE), 64))  # tcp://127.0.0.1
    nixl = registry.get("nixl")
    cfg = TransportConfig(address=served.rx.address, checksum_mode=nixl.checksum_mode, inline_bytes=0)
    before = _listening()
    tx = nixl.make_sender(src.storage.layout.fingerprint(), cfg, pool=src.storage)
    try:
        tx.migrate(src, "a", "r1", 1, dedupe=False)
        assert tx.channel.pull and served.next().request_id == "r1"  # both agents are up: read by NIXL
        ucx = _listening() - before
        assert ucx  # UCX's listeners, which this test can see
        assert all(_loopback(address) for address, _ in ucx), ucx
    finally:
        tx.close()
        served.stop()

"""Helpers shared by the ZeroMQ transport tests (test_transfer_zmq.py, test_transfer_wire.py):
small synthetic pools of one KV shape, a sequence's computed K/V read back as bytes, a snapshot
of a pool's allocator state for "pool unchanged" checks, and `Served`, a ZmqReceiver polled on a
background thread."""

import queue
import threading

import torch

from kvcache.storage import KVLayout
from measure.pools import make_manager
from transfer import errors as E
from transfer.channels.zmq_receiver import ZmqReceiver
from transfer.metrics import TransferMetrics
from transfer.transport import TransportConfig

SHAPE = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float16"}  # 128 bytes a token


def pool(block_size=16, num_blocks=64, **overrides):
    return make_manager(KVLayout(block_size=block_size, **{**SHAPE, **overrides}), num_blocks)


def kv_bytes(manager, seq_id):
    """The computed K/V of a sequence, in token order, as uint8."""
    table = manager.table(seq_id)
    slots = [table.slot(i, manager.block_size) for i in range(table.num_computed)]
    return manager.storage.read_slots(slots).contiguous().view(torch.uint8)


def snapshot(manager):
    allocator = manager.allocator
    return (allocator.num_free, allocator.num_cached, allocator.num_used, sorted(manager.tables, key=str),
            [allocator.ref_count(b) for b in range(allocator.num_blocks)])


class Served:
    """A ZmqReceiver polled on a background thread; results and errors go to `events`.

    With auto_free, each imported sequence's KV is recorded and the sequence freed at once."""

    def __init__(self, manager, address="tcp://127.0.0.1:0", auto_free=False, **config):
        self.manager, self.metrics = manager, TransferMetrics()
        self.rx = ZmqReceiver(manager, TransportConfig(address=address, **config), metrics=self.metrics)
        self.events, self.kv, self.auto_free = queue.Queue(), {}, auto_free
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                result = self.rx.poll(0.05)
            except E.TransferError as e:
                self.events.put(e)
                continue
            if result is not None:
                if self.auto_free:
                    self.kv[result.seq_id] = kv_bytes(self.manager, result.seq_id)
                    self.manager.free(result.seq_id)
                self.events.put(result)

    def next(self, timeout=10.0):
        return self.events.get(timeout=timeout)

    def stop(self):
        self._stop.set()
        self.thread.join(10)
        self.rx.close()

"""Host staging for device pools: a ring of (pinned, when CUDA) host buffers and a side stream.

Export (`DeviceChunks`): the device-to-host copy of chunk i+1 is issued on a copy stream before
chunk i is handed to the transport, so the copy overlaps hashing and sending chunk i; a slot is
reused only after the transport reports it done with the slot (its `tracker`, e.g. a pyzmq
`MessageTracker`). `stage_all` copies whole frames to one host buffer the same way (used when
checksums must be in the manifest before anything is sent).
Import (`DeviceSink`): a chunk lands in a ring slot, is verified there, then copied host-to-device
asynchronously; a slot is reused only after its copy's event has completed.
The same code runs on CPU tensors (synchronous copies), which is how the CPU tests exercise it.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from transfer.errors import TransferTimeout


def flat_bytes(data: torch.Tensor) -> torch.Tensor:
    """The pool tensor as one flat uint8 tensor (a view: the pool is contiguous)."""
    return data.reshape(-1).view(torch.uint8)  # (N * L * 2 * B * H * D * elem,)


class _Slot:
    def __init__(self, nbytes: int, device: torch.device):
        cuda = device.type == "cuda"
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        self.event = torch.cuda.Event() if cuda else None
        self.tracker = None  # set by the consumer: something with .wait(timeout) (zmq MessageTracker)

    def wait_free(self, timeout: float) -> None:
        if self.tracker is not None:
            try:
                self.tracker.wait(timeout)
            except Exception as e:  # zmq.NotDone on timeout
                raise TransferTimeout(f"staging slot still in use by the transport after {timeout}s") from e
            self.tracker = None
        if self.event is not None:
            self.event.synchronize()


class _Ring:
    def __init__(self, device: torch.device, chunk_bytes: int, slots: int):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.slots = [_Slot(chunk_bytes, device) for _ in range(max(2, slots))]

    def copy(self, dst: torch.Tensor, src: torch.Tensor, slot: _Slot) -> None:
        if self.stream is None:
            dst.copy_(src)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            slot.event.record(self.stream)

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


_local = threading.local()


def _ring(device: torch.device, chunk_bytes: int, slots: int) -> _Ring:
    """A ring reused across transfers on this thread (pinned allocations are slow). Safe because
    a thread drives one transfer step at a time and every slot reuse waits for the slot."""
    cache = getattr(_local, "rings", None)
    if cache is None:
        cache = _local.rings = {}
    key = (str(device), chunk_bytes, slots)
    if key not in cache:
        if len(cache) >= 4:
            cache.pop(next(iter(cache)))
        cache[key] = _Ring(device, chunk_bytes, slots)
    return cache[key]


class DeviceChunks:
    """Yields (frame, chunk, host memoryview, slot) for byte ranges of a device pool, in order.

    ranges: (pool byte offset, nbytes) of each frame. The consumer may set `slot.tracker`.
    """

    def __init__(self, data: torch.Tensor, ranges: list[tuple[int, int]], chunk_bytes: int, slots: int = 4,
                 timeout: float = 30.0):
        self.flat = flat_bytes(data)
        self.ring = _ring(data.device, chunk_bytes, slots)
        self.timeout = timeout
        self.items = [(f, c, off + c * chunk_bytes, min(chunk_bytes, n - c * chunk_bytes))
                      for f, (off, n) in enumerate(ranges) for c in range(-(-n // chunk_bytes))]

    def _issue(self, i: int) -> None:
        _, _, off, n = self.items[i]
        slot = self.ring.slots[i % len(self.ring.slots)]
        slot.wait_free(self.timeout)
        self.ring.copy(slot.host[:n], self.flat[off:off + n], slot)

    def __iter__(self):
        if self.items:
            self._issue(0)
        for i, (f, c, _, n) in enumerate(self.items):
            if i + 1 < len(self.items):
                self._issue(i + 1)  # overlaps with the consumer's work on chunk i
            slot = self.ring.slots[i % len(self.ring.slots)]
            if slot.event is not None:
                slot.event.synchronize()
            yield f, c, memoryview(slot.host[:n].numpy()), slot


def stage_all(data: torch.Tensor, ranges: list[tuple[int, int]], chunk_bytes: int) -> tuple[np.ndarray, list]:
    """Copy frames of a device pool into one host buffer; returns it and one memoryview per frame."""
    total = sum(n for _, n in ranges)
    cuda = data.device.type == "cuda"
    host = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
    flat, stream, pos, views = flat_bytes(data), (torch.cuda.Stream(data.device) if cuda else None), 0, []
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(data.device))  # after pending writes to the pool
    for off, n in ranges:
        for c in range(0, n, chunk_bytes):
            k = min(chunk_bytes, n - c)
            if stream is None:
                host[pos + c:pos + c + k].copy_(flat[off + c:off + c + k])
            else:
                with torch.cuda.stream(stream):
                    host[pos + c:pos + c + k].copy_(flat[off + c:off + c + k], non_blocking=True)
        pos += n
    if stream is not None:
        stream.synchronize()
    arr = host.numpy()
    pos = 0
    for _, n in ranges:
        views.append(memoryview(arr[pos:pos + n]))
        pos += n
    return arr, views


class DeviceSink:
    """Import side: chunk -> ring slot (host) -> async copy into device pool byte ranges."""

    def __init__(self, data: torch.Tensor, chunk_bytes: int, slots: int = 4, timeout: float = 30.0):
        self.flat = flat_bytes(data)
        self.ring = _ring(data.device, chunk_bytes, slots)
        self.timeout = timeout
        self._next = 0

    def slot(self) -> _Slot:
        """The next free slot (waits for its previous host-to-device copy)."""
        slot = self.ring.slots[self._next % len(self.ring.slots)]
        self._next += 1
        slot.wait_free(self.timeout)
        return slot

    def scatter(self, slot: _Slot, segments: list[tuple[int, int, int]]) -> None:
        """segments: (pool byte offset, slot byte offset, length) copied host -> device."""
        for dst, src, n in segments:
            self.ring.copy(self.flat[dst:dst + n], slot.host[src:src + n], slot)

    def synchronize(self) -> None:
        self.ring.synchronize()

"""The decode worker's Ray actor: the worker runtime with the decode role handler.

Besides the runtime's typed `command` entry point it exposes the Ray transport's calls
(`kv_hello`, `kv_query`, `kv_receive`, `kv_receive_shm` (same node: frames read from the
sender's pool), and a streamed migration's `kv_offer`, `kv_blocks`, `kv_final`, `kv_cancel`:
msgpack bytes in and out, payload frames as zero-copy arrays), each forwarded to the loop thread
as a typed command, since every pool call happens there. Tokens, imports and refusals reach the
coordinator in the runtime's `WorkerReport`s.
"""

from __future__ import annotations

from decode_worker.handler import DecodeHandler, DecodeWorkerConfig
from decode_worker.ray_commands import KvHello, KvQuery, KvReceive, KvStream
from runtime.actor import WorkerActor


class DecodeWorker(WorkerActor):
    """Actor body: `ray.remote(DecodeWorker).options(name=...).remote(config_dict)`."""

    role = "decode"
    config_class = DecodeWorkerConfig

    def make_handler(self, config, engine):
        return DecodeHandler(config, engine)

    def engine_hooks(self) -> dict:
        # NOTE: the pool is built before the handler; nothing allocates until the handler exists
        return {"held_back": lambda: self.handler.held_back()}

    # Ray transport entry points (RaySender calls these)
    def kv_hello(self, connection: str, data: bytes) -> bytes:
        return self.loop.call(KvHello(connection, data))

    def kv_query(self, connection: str, data: bytes) -> bytes:
        return self.loop.call(KvQuery(connection, data))

    def kv_receive(self, connection: str, manifest: bytes, *frames) -> bytes:
        return self.loop.call(KvReceive(connection, manifest, frames))

    def kv_receive_shm(self, connection: str, manifest: bytes, offsets: bytes) -> bytes:
        return self.loop.call(KvReceive(connection, manifest, (), offsets))

    def kv_offer(self, connection: str, header: bytes, manifest: bytes) -> bytes:
        return self.loop.call(KvStream("ray_offer", connection, header, manifest))

    def kv_blocks(self, connection: str, header: bytes, *frames) -> bytes:
        return self.loop.call(KvStream("ray_blocks", connection, header, b"", frames))

    def kv_final(self, connection: str, header: bytes, final: bytes) -> bytes:
        return self.loop.call(KvStream("ray_final", connection, header, final))

    def kv_cancel(self, connection: str, header: bytes) -> bytes:
        return self.loop.call(KvStream("ray_cancel", connection, header))

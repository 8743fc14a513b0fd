"""The decode worker's Ray actor: the worker runtime with the decode role handler.

Besides the runtime's typed `command` entry point it has one method for the KV channel that
arrives as Ray calls (`transfer.channels.ray_channel`): `kv(conn, headers, *bodies)` delivers the call's
messages to the KV receiver, whose poll on the loop thread serves them (every pool call happens
there), the same receive path every channel takes. Tokens, imports and refusals reach the coordinator in the
runtime's `WorkerReport`s.
"""

from __future__ import annotations

from decode_worker.handler import DecodeHandler, DecodeWorkerConfig
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

    def kv(self, conn: str, headers: bytes, *bodies) -> bytes:
        """A KV channel call (Ray channel), answered by the receiver on the loop thread (bounded)."""
        deliver = getattr(self.handler.receiver, "deliver", None)
        if deliver is None:
            raise RuntimeError(f"this decode worker's KV receiver ({self.config.transport}) takes no calls")
        return deliver(conn, headers, bodies).result(timeout=self.config.call_timeout_s)

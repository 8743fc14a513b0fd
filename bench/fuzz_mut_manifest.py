"""Manifest mutation families of `pdserve bench fuzz`: valid transfers (zmq, stream, dedupe) and
damage to the sealed manifest, either as raw bytes (left unsealed, so the seal refuses them, or
re-sealed, so the msgpack parser sees them) or as structured field edits re-sealed (mostly) so
that they reach the schema validator.
"""

from __future__ import annotations

import msgpack

from bench.fuzz_cases import Case, manifest_body, mutate_bytes, mutate_wire, stream_bytes, transfer_msgs
from transfer.wire import TOKEN
from transfer.wire_codec import seal


def gen_valid_zmq(rng, t, token, rid):
    return Case("valid_zmq", "valid", rid, t, valid=True, msgs=transfer_msgs(t, token, rid))


def gen_valid_stream(rng, t, token, rid):
    return Case("valid_stream", "valid", rid, t, valid=True, msgs=[[TOKEN.pack(b"S", token),
                seal(manifest_body(t, rid))]], stream=[("open", "ok"), ("bytes", stream_bytes(t, token)),
                                                       ("close",)], wait_token=token)


def gen_valid_dedupe(rng, t, token, rid):
    return Case("valid_dedupe", "valid", rid, t, valid=True, dedupe=True)


def gen_manifest_bytes(rng, t, token, rid):
    """Raw byte damage to the sealed manifest, not re-sealed: the seal must refuse it."""
    body, op = mutate_bytes(rng, seal(manifest_body(t, rid)))
    return Case("manifest_bytes", op, rid, t, msgs=transfer_msgs(t, token, rid, sealed=body))


def gen_manifest_resealed(rng, t, token, rid):
    """Raw byte damage to the manifest's msgpack, re-sealed: the parser and schema see it."""
    body, op = mutate_bytes(rng, manifest_body(t, rid))
    return Case("manifest_resealed", op, rid, t, msgs=transfer_msgs(t, token, rid, sealed=seal(body)))


def gen_manifest_fields(rng, t, token, rid):
    """Structured field edits; re-sealed (mostly) so they reach the schema validator."""
    wire = dict(t.wire, request_id=rid)
    d, op = mutate_wire(rng, wire)
    body = msgpack.packb(d, use_bin_type=True)
    resealed = rng.random() < 0.9
    if not resealed:
        op += "+unsealed"
    sealed = seal(body) if resealed else body + rng.randbytes(8)
    return Case("manifest_fields", op, rid, t, msgs=transfer_msgs(t, token, rid, sealed=sealed))

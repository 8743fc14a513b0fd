"""Case generators of `pdserve bench fuzz` (`bench.fuzz` drives them against a live receiver).

Every case starts from a valid transfer of a real exported sequence (`Template`) and applies one
seeded mutation family: raw bytes of the sealed manifest (left unsealed, so the seal refuses
them, or re-sealed, so the msgpack parser sees them), structured edits of the manifest's fields
(out-of-range numbers, wrong types, huge lists, deleted and unknown keys, wrong versions and
kinds; re-sealed so they reach the schema validator), message headers (kinds, lengths, tokens,
parts), handshakes and dedupe queries, payload chunks (dropped, repeated, reordered, truncated,
extended, flipped, misnumbered), message order, and the bulk link (OPEN, XFER and CHUNK
headers, early close, extra bytes). Valid transfers are mixed in. A `Case` is plain data: the
control messages to send after the handshake, and stream operations the runner materializes
with the connection's real stream token. The case data and builders live in `bench.fuzz_cases`,
the families in `bench.fuzz_mut_manifest`, `bench.fuzz_mut_messages` and `bench.fuzz_mut_stream`.
"""

from __future__ import annotations

import random

from bench.fuzz_cases import (  # noqa: F401 - re-exported: the case data and builders live there
    INTS,
    OTHERS,
    Case,
    Template,
    data_msgs,
    manifest_body,
    mutate_bytes,
    mutate_wire,
    stream_bytes,
    transfer_msgs,
)
from bench.fuzz_mut_manifest import (
    gen_manifest_bytes,
    gen_manifest_fields,
    gen_manifest_resealed,
    gen_valid_dedupe,
    gen_valid_stream,
    gen_valid_zmq,
)
from bench.fuzz_mut_messages import gen_chunks, gen_header, gen_hello, gen_query, gen_sequence
from bench.fuzz_mut_stream import gen_abandon, gen_stream, gen_stream_slow

FAMILIES = {  # name: (generator, weight)
    "valid_zmq": (gen_valid_zmq, 8),
    "valid_stream": (gen_valid_stream, 4),
    "valid_dedupe": (gen_valid_dedupe, 2),
    "manifest_bytes": (gen_manifest_bytes, 8),
    "manifest_resealed": (gen_manifest_resealed, 10),
    "manifest_fields": (gen_manifest_fields, 22),
    "header": (gen_header, 10),
    "hello": (gen_hello, 8),
    "query": (gen_query, 5),
    "chunks": (gen_chunks, 12),
    "sequence": (gen_sequence, 5),
    "stream": (gen_stream, 8),
    "stream_slow": (gen_stream_slow, 1),
    "abandon": (gen_abandon, 1),
}


def pick_family(rng: random.Random, index: int) -> str:
    """Round-robin over the families for the first cases (each is exercised), then by weight."""
    names = list(FAMILIES)
    if index < len(names):
        return names[index]
    return rng.choices(names, weights=[w for _, w in FAMILIES.values()])[0]

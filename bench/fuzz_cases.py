"""Case data and builders of `pdserve bench fuzz`: the `Template` of a valid transfer of a real
exported sequence, the `Case` the runner plays, helpers that build a template's control messages
and bulk link (optionally with damaged fields), and the generic byte and structured wire-dict
mutations that the family generators (`bench.fuzz_mut_*`) apply.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field

import msgpack

from transfer.channels.bulk_wire import CHUNK, END, XFER, XFER_MAGIC
from transfer.wire import DATA, TOKEN
from transfer.wire_codec import seal

INTS = [-1, 0, 1, 2, 3, 7, 15, 16, 17, 4095, 4096, 4097, 1 << 12, (1 << 12) + 1, 1 << 21, (1 << 21) + 1,
        1 << 24, (1 << 24) + 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 1 << 40, (1 << 40) + 1, 2**63 - 1,
        -2**63, 2**64 - 1, -2**31]
OTHERS = [None, True, False, 0.5, -1.0, float("nan"), float("inf"), 1e300, "", "x", "\u00e9" * 3,
          "x" * 5000, b"", b"\x00" * 7, b"\xff" * 8, b"\x01" * 4, [], [1, 2], [[0, 1, 2048, None]], {},
          {"a": 1}, {"v": 4}]


@dataclass
class Template:
    """A valid transfer of one exported sequence: its manifest as a wire dict and its chunks."""

    name: str
    wire: dict                      # manifest wire dict (request_id replaced per case)
    chunks: list                    # [(frame, chunk, bytes, xxh3)]
    inline: bool                    # checksum_mode == "inline": chunk headers carry the checksum
    block_size: int                 # the sender's block size (selects the connection)
    digest: int                     # measure.pools.kv_digest of the source sequence
    seq_id: str                     # the source sequence (for dedupe cases)
    hashes: list = field(default_factory=list)  # prefix hashes at the receiver's block size


@dataclass
class Case:
    family: str
    op: str
    request_id: str
    template: Template
    valid: bool = False
    lane: str = "main"              # "main" (shared connection), "fresh" (own connection), "pending"
    hello: object = "ok"            # fresh/pending lanes: "ok", None (no hello) or hello body bytes
    stream_hello: bool = False      # fresh/pending lanes: ask for a bulk link
    msgs: list = field(default_factory=list)      # control messages [[header, body, ...], ...]
    stream: list | None = None      # ("open", mode), ("bytes", b), ("zmq", message), ("close",), ("stall",)
    wait_token: int | None = None   # stream cases: the transfer whose verdict ends the case
    vanish: bool = False            # pending lane: close the control connection at once
    dedupe: bool = False            # valid_dedupe: the runner queries, exports with reuse and sends


def manifest_body(t: Template, request_id: str, wire: dict | None = None) -> bytes:
    d = dict(t.wire if wire is None else wire)
    d["request_id"] = request_id
    return msgpack.packb(d, use_bin_type=True)


def _d(token: int, f: int, c: int, cs: int) -> bytes:
    """A data header with every field wrapped into its width (mutations may overflow them)."""
    return DATA.pack(b"D", token % 2**64, f % 2**32, c % 2**32, cs % 2**64)


def data_msgs(t: Template, token: int) -> list:
    return [[DATA.pack(b"D", token, f, c, cs if t.inline else 0), data] for f, c, data, cs in t.chunks]


def transfer_msgs(t: Template, token: int, request_id: str, sealed: bytes | None = None, kind=b"M") -> list:
    body = sealed if sealed is not None else seal(manifest_body(t, request_id))
    return [[TOKEN.pack(kind, token), body]] + data_msgs(t, token) + [[TOKEN.pack(b"E", token), b""]]


def stream_bytes(t: Template, token: int, chunks=None, nbytes=None, end=True) -> bytes:
    chunks = t.chunks if chunks is None else chunks
    payload = sum(len(c[2]) for c in t.chunks) if nbytes is None else nbytes
    parts = [XFER.pack(XFER_MAGIC, token, payload % 2**64)]
    for f, c, data, cs in chunks:
        parts += [CHUNK.pack(f % 2**32, c % 2**32, (cs if t.inline else 0) % 2**64), data]
    if end:
        parts.append(CHUNK.pack(END, 0, 0))
    return b"".join(parts)


# ---- generic byte mutations ---------------------------------------------------------------------
def mutate_bytes(rng: random.Random, data: bytes, max_ops: int = 3) -> tuple[bytes, str]:
    b = bytearray(data)
    ops = []
    for _ in range(rng.randint(1, max_ops)):
        op = rng.choice(("flip", "flip", "set", "truncate", "extend", "insert", "delete", "dup", "marker"))
        ops.append(op)
        n = len(b)
        if op == "flip" and n:
            for _ in range(rng.randint(1, 8)):
                i = rng.randrange(n)
                b[i] ^= 1 << rng.randrange(8)
        elif op == "set" and n:
            b[rng.randrange(n)] = rng.randrange(256)
        elif op == "truncate":
            del b[rng.randint(0, n):]
        elif op == "extend":
            b += rng.randbytes(rng.choice((1, 2, 8, 64, 1000)))
        elif op == "insert":
            i = rng.randint(0, n)
            b[i:i] = rng.randbytes(rng.randint(1, 16))
        elif op == "delete" and n:
            i = rng.randrange(n)
            del b[i:i + rng.randint(1, 16)]
        elif op == "dup" and n:
            i = rng.randrange(n)
            b[i:i] = b[i:i + rng.randint(1, 64)]
        elif op == "marker" and n:  # msgpack type bytes: containers, big ints, str/bin/ext headers
            b[rng.randrange(n)] = rng.choice((0xc0, 0xc1, 0xc4, 0xc6, 0xc7, 0xcf, 0xd3, 0xd9, 0xdb, 0xdc,
                                              0xdd, 0xde, 0xdf, 0x9f, 0x8f, 0xbf, 0xff))
    return bytes(b), "+".join(ops)


# ---- structured manifest mutations -----------------------------------------------------------------
def _paths(obj, prefix=()):
    """Every (container path, key) in a nested wire dict/list."""
    out = []
    items = obj.items() if isinstance(obj, dict) else enumerate(obj[:64]) if isinstance(obj, list) else ()
    for k, v in items:
        out.append(prefix + (k,))
        if isinstance(v, (dict, list)):
            out += _paths(v, prefix + (k,))
    return out


def _at(obj, path):
    for k in path:
        obj = obj[k]
    return obj


def _any(rng: random.Random):
    return copy.deepcopy(rng.choice(INTS + OTHERS))


def _new_value(rng: random.Random, old):
    r = rng.random()
    if type(old) is int and r < 0.45:  # kept inside what msgpack can carry
        new = rng.choice((old + 1, old - 1, -old, old * 2, old + rng.randint(2, 1000), rng.choice(INTS)))
        return min(max(new, -2**63), 2**64 - 1)
    if type(old) is bytes and r < 0.5:
        k = rng.choice(("short1", "extra_item", "swap", "random", "zero", "huge", "empty"))
        if k == "short1":
            return old[:-1]
        if k == "extra_item":
            return old + old[-8:] if old else b"\x01" * 4
        if k == "swap" and len(old) >= 8:
            return old[len(old) // 2:] + old[:len(old) // 2]
        if k == "random":
            return rng.randbytes(len(old))
        if k == "zero":
            return bytes(len(old))
        if k == "huge":
            return b"\x00" * rng.choice((4096, 65536, 1 << 20, (1 << 23) + 8))
        return b""
    if type(old) is str and r < 0.4:
        return rng.choice(("", old + "x", old.upper(), "x" * 2000, "resident", "\x00", "fz0"))
    if type(old) is list and r < 0.4:
        if rng.random() < 0.5 and old:  # long lists of small items (messages stay a few MB at most)
            small = len(old) < 8 and len(msgpack.packb(old, use_bin_type=True)) < 64
            return old * rng.choice((2, 10, 1000, 70000)) if small else old[:-1]
        return [] if rng.random() < 0.5 else old + [_any(rng)]
    return _any(rng)


def mutate_wire(rng: random.Random, wire: dict) -> tuple[dict, str]:
    """A structured edit of a (deep-copied) manifest or message wire dict."""
    d = copy.deepcopy(wire)
    ops = []
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        op = rng.choice(("set", "set", "set", "set", "delete", "unknown", "version", "kind", "nest"))
        paths = _paths(d)
        if op == "version":
            d["v"] = rng.choice((0, 1, 2, 3, 5, 255, -1, 2**64 - 1, "4", 4.0, None, True))
        elif op == "kind":
            d["kind"] = rng.choice(("hello", "ack", "nack", "query", "", "MANIFEST", 7, None, b"manifest"))
        elif op == "unknown":
            parent = _at(d, rng.choice([p[:-1] for p in paths] + [()]))
            if isinstance(parent, dict):
                parent[rng.choice(("x", "extra", "V", "", "kind2"))] = _any(rng)
            elif isinstance(parent, list):
                parent.append(_any(rng))
        elif op == "delete" and paths:
            p = rng.choice(paths)
            parent = _at(d, p[:-1])
            del parent[p[-1]]
        elif op == "nest" and paths:  # a container where a scalar belongs, or deep nesting
            p = rng.choice(paths)
            _at(d, p[:-1])[p[-1]] = [[[[[]]]]] if rng.random() < 0.5 else {"a": {"b": {"c": [1]}}}
        elif paths:
            p = rng.choice(paths)
            parent = _at(d, p[:-1])
            parent[p[-1]] = _new_value(rng, parent[p[-1]])
            op = "set:" + ".".join(str(k) for k in p[:2])
        ops.append(op.split(":")[0] if len(ops) else op)
    return d, "+".join(ops)

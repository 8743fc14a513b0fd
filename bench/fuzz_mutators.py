"""Case generators of `pdserve bench fuzz` (`bench.fuzz` drives them against a live receiver).

Every case starts from a valid transfer of a real exported sequence (`Template`) and applies one
seeded mutation family: raw bytes of the sealed manifest (left unsealed, so the seal refuses
them, or re-sealed, so the msgpack parser sees them), structured edits of the manifest's fields
(out-of-range numbers, wrong types, huge lists, deleted and unknown keys, wrong versions and
kinds; re-sealed so they reach the schema validator), message headers (kinds, lengths, tokens,
parts), handshakes and dedupe queries, payload chunks (dropped, repeated, reordered, truncated,
extended, flipped, misnumbered), message order, and the raw data stream (OPEN, XFER and CHUNK
headers, early close, extra bytes). Valid transfers are mixed in. A `Case` is plain data: the
control messages to send after the handshake, and stream operations the runner materializes
with the connection's real stream token.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field

import msgpack

from transfer.checksum import checksum
from transfer.codec import seal
from transfer.stream_wire import CHUNK, END, XFER, XFER_MAGIC
from transfer.zmq_wire import DATA, TOKEN

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
    digest: int                     # bench.pools.kv_digest of the source sequence
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
    stream_hello: bool = False      # fresh/pending lanes: ask for a data stream
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


# ---- families --------------------------------------------------------------------------------------
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


def gen_header(rng, t, token, rid):
    msgs = transfer_msgs(t, token, rid)
    i = rng.choice((0, len(msgs) - 1, rng.randrange(len(msgs))))
    header = msgs[i][0]
    op = rng.choice(("kind", "truncate", "extend", "token", "long", "empty", "one_part", "three_parts",
                     "bytes", "H_kind"))
    if op == "kind":
        header = bytes([rng.choice(b"QMSDEANhqxZ\x00\xff")]) + header[1:]
    elif op == "H_kind":
        header = b"H"
    elif op == "truncate":
        header = header[:rng.randrange(len(header))]
    elif op == "extend":
        header = header + rng.randbytes(rng.randint(1, 8))
    elif op == "token":
        new = rng.choice((token + 1, token - 1, 0, 2**64 - 1, rng.getrandbits(64)))
        header = header[:1] + new.to_bytes(8, "little") + header[9:]
    elif op == "long":
        header = header + b"\0" * (65 - len(header))
    elif op == "empty":
        header = b""
    elif op == "bytes":
        header, _ = mutate_bytes(rng, header, 2)
    msg = [header] + msgs[i][1:]
    if op == "one_part":
        msg = [header]
    elif op == "three_parts":
        msg = msg + [rng.randbytes(rng.randint(0, 32))]
    msgs[i] = msg
    return Case("header", f"{op}@{'MDE'[0 if i == 0 else 2 if i == len(msgs) - 1 else 1]}", rid, t, msgs=msgs)


def gen_hello(rng, t, token, rid):
    from transfer.messages import Hello

    fp = dict(t.wire["fingerprint"])
    k = rng.random()
    if k < 0.1:
        hello, op = None, "no_hello"
    elif k < 0.55:
        d, op = mutate_wire(rng, Hello(fp, "fuzz").to_wire())
        hello = msgpack.packb(d, use_bin_type=True)
    elif k < 0.75:
        hello, op = mutate_bytes(rng, msgpack.packb(Hello(fp, "fuzz").to_wire(), use_bin_type=True))
    else:
        key = rng.choice(("model", "dtype", "num_layers", "head_dim", "block_size", "layout", "stream"))
        w = Hello(fp, "fuzz").to_wire()
        if key == "stream":
            w["stream"] = rng.choice(("udp", "tcp", "ipc", "TCP", "x" * 9))
        else:
            w["fingerprint"][key] = rng.choice((fp[key] * 2, "other", 8, 32, 1)) if type(fp[key]) is int \
                else fp[key] + "-other"
        hello, op = msgpack.packb(w, use_bin_type=True), f"fingerprint.{key}"
    return Case("hello", op, rid, t, lane="fresh", hello=hello, msgs=transfer_msgs(t, token, rid))


def gen_query(rng, t, token, rid):
    from transfer.messages import Query

    w = Query(rid, 16, tuple(t.hashes)).to_wire()
    k = rng.random()
    if k < 0.15:
        body, op = msgpack.packb(w, use_bin_type=True), "valid"
    elif k < 0.7:
        d, op = mutate_wire(rng, w)
        body = msgpack.packb(d, use_bin_type=True)
    else:
        body, op = mutate_bytes(rng, msgpack.packb(w, use_bin_type=True))
    msgs = [[b"Q", body]]
    if rng.random() < 0.3:  # a query in the middle of a transfer
        msgs = transfer_msgs(t, token, rid)
        msgs.insert(rng.randint(1, len(msgs) - 1), [b"Q", body])
        op += "+mid_transfer"
    return Case("query", op, rid, t, msgs=msgs)


def gen_chunks(rng, t, token, rid):
    m = transfer_msgs(t, token, rid)
    head, data, end = m[0], m[1:-1], m[-1]
    tail, ops = [end], []
    for _ in range(rng.choice((1, 1, 2, 3))):
        op = rng.choice(("drop", "dup", "swap", "truncate", "extend", "flip", "checksum", "index", "extra",
                         "split", "empty", "stray_token", "early_end", "late"))
        ops.append(op)
        if not data:
            data = [[DATA.pack(b"D", token, 0, 0, 0), b"x"]]
        i = rng.randrange(len(data))
        h, body = data[i][0], data[i][-1]
        if len(h) != DATA.size:  # an end marker moved in by an earlier op
            h = DATA.pack(b"D", token, 0, 0, 0)
        _, tok, f, c, cs = DATA.unpack(h)
        if op == "drop":
            del data[i]
        elif op == "dup":
            data.insert(i, list(data[i]))
        elif op == "swap":
            j = rng.randrange(len(data))
            data[i], data[j] = data[j], data[i]
        elif op == "truncate":
            data[i] = [h, body[:rng.randrange(max(1, len(body)))]]
        elif op == "extend":
            data[i] = [h, body + rng.randbytes(rng.choice((1, 7, 4096)))]
        elif op == "flip" and body:
            b = bytearray(body)
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            data[i] = [h, bytes(b)]
        elif op == "checksum":
            data[i] = [_d(tok, f, c, cs ^ (1 << rng.randrange(64))), body]
        elif op == "index":
            nf, nc = rng.choice(((f + 1, c), (f, c + 1), (f, c - 1 if c else 2**32 - 1), (2**32 - 1, 0),
                                 (f, 2**32 - 1), (END, 0)))
            data[i] = [_d(tok, nf, nc, cs), body]
        elif op == "extra":
            data.append([_d(tok, f, c + 1000, checksum(body)), body])
        elif op == "split":
            data[i] = [h, body[:len(body) // 2], body[len(body) // 2:]]
        elif op == "empty":
            data[i] = [h, b""]
        elif op == "stray_token":
            data[i] = [_d(tok + 1, f, c, cs), body]
        elif op == "early_end":
            data.insert(i, list(end))
        elif op == "late":  # a chunk after the end
            tail.append(data.pop(i))
    return Case("chunks", "+".join(ops), rid, t, msgs=[head] + data + tail)


def gen_sequence(rng, t, token, rid):
    m = transfer_msgs(t, token, rid)
    op = rng.choice(("dup_manifest", "second_manifest", "dup_end", "shuffle", "reverse", "no_manifest",
                     "hello_mid", "interleave", "manifest_after_end", "stale_token_end"))
    if op == "dup_manifest":
        m.insert(rng.randint(1, len(m) - 1), list(m[0]))
    elif op == "second_manifest":  # a new transfer abandons the previous one mid-way
        m2 = transfer_msgs(t, token + 1, rid + "b")
        m = m[:rng.randint(1, len(m) - 1)] + m2
    elif op == "dup_end":
        m.append(list(m[-1]))
    elif op == "shuffle":
        rng.shuffle(m)
    elif op == "reverse":
        m.reverse()
    elif op == "no_manifest":
        m = m[1:]
    elif op == "hello_mid":
        from transfer.messages import Hello

        hello = msgpack.packb(Hello(dict(t.wire["fingerprint"]), "fuzz").to_wire(), use_bin_type=True)
        m.insert(rng.randint(1, len(m) - 1), [b"H", hello])
    elif op == "interleave":
        m2 = transfer_msgs(t, token + 1, rid + "b")
        m = [x for pair in zip(m, m2) for x in pair] + m[len(m2):] + m2[len(m):]
    elif op == "manifest_after_end":
        m.append(list(m[0]))
    elif op == "stale_token_end":
        m.insert(rng.randint(1, len(m) - 1), [TOKEN.pack(b"E", token - 1), b""])
    return Case("sequence", op, rid, t, msgs=m)


def gen_stream(rng, t, token, rid):
    """Stream mutations the receiver answers at once (after the reader claimed the transfer)."""
    sealed = seal(manifest_body(t, rid))
    chunks = list(t.chunks)
    op = rng.choice(("nbytes", "chunk_index", "chunk_checksum", "chunk_flip", "drop", "dup", "swap",
                     "early_end", "extra_chunk", "cut", "extra_bytes", "bytes", "refused_manifest",
                     "zmq_manifest", "end_mid_stream"))
    nbytes, end, tail, kind = None, True, b"", b"S"
    if op == "nbytes":
        total = sum(len(c[2]) for c in chunks)
        nbytes = rng.choice((0, total - 1, total + 1, total + 4096, 2**64 - 1, total * 2))
    elif op == "chunk_index":
        i = rng.randrange(len(chunks))
        f, c, data, cs = chunks[i]
        chunks[i] = rng.choice(((f + 1, c), (f, c + 1), (2**32 - 2, 0), (f, 2**32 - 1))) + (data, cs)
    elif op == "chunk_checksum":
        i = rng.randrange(len(chunks))
        f, c, data, cs = chunks[i]
        chunks[i] = (f, c, data, cs ^ 1) if t.inline else (f, c, data[:-1] + bytes([data[-1] ^ 1]), cs)
    elif op == "chunk_flip":
        i = rng.randrange(len(chunks))
        f, c, data, cs = chunks[i]
        b = bytearray(data)
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        chunks[i] = (f, c, bytes(b), cs)
    elif op == "drop":
        del chunks[rng.randrange(len(chunks))]
    elif op == "dup":
        i = rng.randrange(len(chunks))
        chunks.insert(i, chunks[i])
    elif op == "swap" and len(chunks) > 1:
        i, j = rng.sample(range(len(chunks)), 2)
        chunks[i], chunks[j] = chunks[j], chunks[i]
    elif op == "early_end":
        chunks = chunks[:rng.randrange(len(chunks))]
    elif op == "extra_chunk":
        f, c, data, cs = chunks[-1]
        chunks.append((f, c + 1, data, cs))
    elif op == "extra_bytes":
        tail = rng.randbytes(rng.choice((1, 8, 24, 100)))
    elif op == "refused_manifest":
        b = bytearray(sealed)
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        sealed = bytes(b)
    elif op == "zmq_manifest":  # a ZeroMQ-path manifest whose payload also shows up on the stream
        kind = b"M"
    data = stream_bytes(t, token, chunks, nbytes, end) + tail
    if op == "cut":  # after the XFER header (before it, nothing is claimed: see stream_slow)
        data = data[:rng.randint(XFER.size, len(data) - 1)]
    elif op == "bytes":  # damage anywhere after the XFER header
        head, rest = data[:XFER.size], data[XFER.size:]
        rest, sub = mutate_bytes(rng, rest)
        data, op = head + rest, "bytes:" + sub
    msgs = [[TOKEN.pack(kind, token), sealed]]
    ops = [("open", "ok"), ("bytes", data), ("close",)]
    if op == "end_mid_stream":  # a ZeroMQ end marker while the payload lands on the stream
        cut = rng.randint(0, len(data))
        ops[1:2] = [("bytes", data[:cut]), ("zmq", [TOKEN.pack(b"E", token), b""]), ("bytes", data[cut:])]
    if kind == b"M":
        msgs = transfer_msgs(t, token, rid)
    return Case("stream", op, rid, t, msgs=msgs, stream=ops, wait_token=token)


def gen_stream_slow(rng, t, token, rid):
    """Stream mutations that leave an admitted transfer waiting: the receiver's timeouts end them."""
    sealed = seal(manifest_body(t, rid))
    op = rng.choice(("open_token", "open_magic", "open_short", "xfer_magic", "xfer_token", "cut_xfer",
                     "stall", "no_stream", "no_stream_hello"))
    data = stream_bytes(t, token)
    stream = [("open", "ok")]
    if op.startswith("open_"):
        stream = [("open", op[5:])]
    elif op == "xfer_magic":
        stream.append(("bytes", b"PDKVXFEX" + data[8:]))
    elif op == "xfer_token":
        stream.append(("bytes", XFER.pack(XFER_MAGIC, token + 7, 1) + data[XFER.size:]))
    elif op == "cut_xfer":
        stream.append(("bytes", data[:rng.randrange(XFER.size)]))
    elif op == "stall":
        stream += [("bytes", data[:rng.randint(XFER.size, len(data) - 1)]), ("stall",)]
    elif op == "no_stream":
        stream = []
    if op != "stall":
        stream.append(("close",))
    return Case("stream_slow", op, rid, t, lane="pending", stream_hello=op != "no_stream_hello",
                msgs=[[TOKEN.pack(b"S", token), sealed]], stream=stream if op != "no_stream_hello" else None,
                wait_token=token)


def gen_abandon(rng, t, token, rid):
    """A sender that vanishes or stalls mid-transfer (the receiver's idle timeout ends it)."""
    m = transfer_msgs(t, token, rid)
    op = rng.choice(("vanish", "stall"))
    return Case("abandon", op, rid, t, lane="pending", msgs=m[:rng.randint(1, len(m) - 1)],
                vanish=op == "vanish", wait_token=None if op == "vanish" else token)


FAMILIES = {  # name: (generator, weight)
    "valid_zmq": (gen_valid_zmq, 8),
    "valid_stream": (gen_valid_stream, 4),
    "valid_dedupe": (gen_valid_dedupe, 2),
    "manifest_bytes": (gen_manifest_bytes, 8),
    "manifest_resealed": (gen_manifest_resealed, 10),
    "manifest_fields": (gen_manifest_fields, 22),
    "header": (gen_header, 10),
    "hello": (gen_hello, 4),
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

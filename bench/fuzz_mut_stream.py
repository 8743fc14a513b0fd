"""Data-stream mutation families of `pdserve bench fuzz`: damaged OPEN, XFER and CHUNK headers,
payload edits on the stream, early close and extra bytes (answered at once), plus the cases that
leave an admitted transfer waiting (stalled streams, vanished senders) so that only the receiver's
timeouts end them.
"""

from __future__ import annotations

from bench.fuzz_cases import Case, manifest_body, mutate_bytes, stream_bytes, transfer_msgs
from transfer.channels.bulk_wire import XFER, XFER_MAGIC
from transfer.wire import TOKEN
from transfer.wire_codec import seal


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

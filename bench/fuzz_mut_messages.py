"""Control-message mutation families of `pdserve bench fuzz`: message headers (kinds, lengths,
tokens, parts), handshakes (`Hello`) and dedupe queries, payload chunks (dropped, repeated,
reordered, truncated, extended, flipped, misnumbered) and the order of a transfer's messages.
Hellos are also signed (the runner signs them with the run's secret) and then damaged: tag and
nonce non-ASCII, of the wrong length or type, huge; another receiver's name; stale; replayed;
and bodies over the pre-authentication bound.
"""

from __future__ import annotations

import time

import msgpack

from bench.fuzz_cases import Case, _d, mutate_bytes, mutate_wire, transfer_msgs
from transfer.channels.bulk_wire import END
from transfer.checksum import checksum
from transfer.wire import DATA, TOKEN


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


HEX_EDITS = ["\u00e9" * 64, "\u00e9" * 32, "\U0001f642" * 16, "ab", "", "x" * 64, "AB" * 32, "0" * 63,
             "0" * 65, "\x00" * 64, "a" * 5000, "a" * 200_000, 12345, None, b"\xff" * 32, ["ab"] * 4]
SIGNED_EDITS = {"tag": HEX_EDITS, "nonce": HEX_EDITS,
                "to": ["", "other-rx", "fuzz-rx\x00", "FUZZ-RX", "x" * 2000],
                "issued_at": ["stale", 1e12, -1.0, float("nan"), float("inf"), "now", 2**64 - 1, None],
                "peer": ["x" * 2000, "\u00e9", 7], "replay": [None]}


def gen_hello(rng, t, token, rid):
    from transfer.wire_messages import Hello

    fp = dict(t.wire["fingerprint"])
    k = rng.random()
    if k < 0.4:  # a signed hello (the runner signs it) with its tag, nonce, receiver... damaged
        field = rng.choice(list(SIGNED_EDITS))
        value = rng.choice(SIGNED_EDITS[field])
        if value == "stale":
            value = time.time() - rng.choice((61.0, 3600.0))
        op = f"signed.{field}:{type(value).__name__}{len(value) if isinstance(value, (str, bytes)) else ''}"
        msgs = transfer_msgs(t, token, rid)
        return Case("hello", op, rid, t, lane="fresh", hello=(field, value), msgs=msgs)
    if k < 0.5:  # oversized before any handshake: refused unread
        n = rng.choice((8 << 10, 64 << 10, 1 << 20, 8 << 20))
        big = rng.choice((lambda: list(range(n // 4)), lambda: {"fingerprint": fp, "peer": "x" * n},
                          lambda: b"\x00" * n))()
        hello = msgpack.packb(big, use_bin_type=True)
        msgs = transfer_msgs(t, token, rid)
        return Case("hello", f"oversized:{n}", rid, t, lane="fresh", hello=hello, msgs=msgs)
    k = (k - 0.5) / 0.5
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
    from transfer.wire_messages import Query

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
        from transfer.wire_messages import Hello

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

"""The wire format of KV migration's messages, the same on every channel (`channels.zmq` over
ZeroMQ sockets: the decode side binds a ROUTER, each prefill side connects a DEALER;
`channels.ray` in Ray actor calls), and the KV addresses they use (`bind_address`,
`parse_address`, `cluster_host`). Every message is two parts,
[header, body] (the ROUTER adds the peer identity in front):
  H / h     hello / reply (msgpack Hello; HelloReply or Nack)
  Q / q     dedupe query / reply (Query; Held or Nack)
  U / u     the sender offers its pool to read payloads from / reply (PoolOffer; PoolReply or Nack)
  M+token   manifest (msgpack Manifest)
  D+token+frame+chunk+xxh3   one payload chunk: raw bytes, sent zero-copy from pool memory
  E+token   end of payload (empty body)
  S+token   manifest whose payload comes on the bulk link (bulk_wire)
  O+token   a streamed offer (the prompt still computing): payload on the bulk link, then F
  W+token   a streamed offer whose chunks come as D messages here (no bulk link), then F
  F+token   a streamed transfer's final state (msgpack Final, sealed)
  C+token   the sender cancels its transfer (empty body)
  P+token   instead of D...E: each frame's offset in the offered pool (uint64 LE; transfer.pull)
  K+token   after P, when the manifest's checksums are "inline": every chunk's xxh3-64 in order
            (uint64 LE), hashed by the sender while the receiver reads
  A+token   ack or nack of a transfer (msgpack Ack or Nack)
  N         nack of a garbled message
Chunks are separate messages rather than one multipart message (ZeroMQ delivers a multipart
message only once all of it has arrived), so the receiver copies chunk i into place while the
I/O thread reads chunk i+1. The token (a per-connection counter) tells a late chunk of an
abandoned transfer from one of the current transfer.
"""

from __future__ import annotations

import struct

DATA = struct.Struct("<cQIIQ")  # b"D", token, frame, chunk, checksum
TOKEN = struct.Struct("<cQ")    # b"M" / b"E" / b"A", token


def bind_address(address: str) -> str:
    """tcp://host:0 -> tcp://host:* (ZeroMQ's any-free-port form); other addresses unchanged."""
    return address[:-2] + ":*" if address.startswith("tcp://") and address.endswith(":0") else address


def parse_address(address: str) -> tuple[str, str]:
    """("tcp", host) for tcp://host:port, ("ipc", path) for ipc://path."""
    if address.startswith("tcp://"):
        host = address[len("tcp://"):].rsplit(":", 1)[0]
        return "tcp", host.strip("[]")
    if address.startswith("ipc://"):
        return "ipc", address[len("ipc://"):]
    raise ValueError(f"not a tcp:// or ipc:// address: {address!r}")


def cluster_host(address: str) -> str:
    """The host of a KV address as the cluster uses it: tcp://HOST:PORT -> HOST; ipc:// (one node)
    -> loopback; anything else -> "" (not known)."""
    try:
        scheme, where = parse_address(address)
    except ValueError:
        return ""
    return where if scheme == "tcp" else "127.0.0.1"

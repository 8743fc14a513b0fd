"""KV migration: moving one sequence's paged KV cache from a prefill worker's pool into a decode
worker's pool, fast and provably intact. A versioned msgpack manifest (`manifest`, sent with the
connection messages of `wire_messages` through `wire_codec`, bounded by `schema.Limits`) describes the
sequence — layout fingerprint, blocks and their prefix hashes, payload frames with xxh3 checksums
(`checksum`), and the state decode needs to continue — and raw payload frames follow, read
straight from pool memory (`export`), or re-blocked by the sender into the receiver's block size
(`export_reblock`), and written straight into blocks the receiver reserved all-or-nothing once
the manifest passed its checks (`importer`, `import_checks`, `import_segments`; a receiver staged
and re-blocked (`reblock`) for senders that did not), staged through pinned host buffers for
device pools (`staging`), with duplicate prefix blocks shared rather than sent (`blocks`), stale
epochs refused (`epochs`) and sender blocks leased until the ack (`lease`). Payloads under
`TransportConfig.inline_bytes` make one round trip: no dedupe query, the receiver shares what it
caches. The protocol is written once on each side: `session.SenderSession` sends (hello, query,
and one transfer loop where a whole migration is a one-item feed, streamed migrations offered
while the prompt computes: `stream_export`), `receiver.MessageReceiver` receives (with
`receiver_hello` and `receiver_transfers`), over messages of one wire format (`wire`). A
transport is only a channel that moves them (`channel` states the contract; `registry` finds a
transport by name and declares its options), one entry file per transport in `channels/` holding
both of its sides: ZeroMQ (`channels.zmq`, with the payload on a raw TCP/Unix bulk link:
`channels.bulk_wire`, `bulk_sender`, `bulk_receiver`), Ray actor calls (`channels.ray`), and NIXL
(`channels.nixl`, `nixl_pool`: ZeroMQ control, the payload read one-sided from the sender's
registered pool). A receiver may read a payload from the sender's
own pool instead of the wire (`pull`: a same-node /dev/shm pool, or NIXL). `faults` injects the
chaos benchmark's transfer faults, applied by the session. Every failure is a typed
`errors.TransferError`, counted in `metrics`, and leaves the receiver's pool unchanged. The
migration benchmark (`pdserve bench migrate`) and its synthetic pools live in the top-level
`bench` package, which nothing here imports.

Entry points for workers: `export_sequence` / `import_sequence` (in process), `ImportSession`
(driven chunk by chunk), `registry.get(name).make_sender(...)` / `.make_receiver(...)`.
"""

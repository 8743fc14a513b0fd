"""KV migration: moving one sequence's paged KV cache from a prefill worker's pool into a decode
worker's pool, fast and provably intact. A versioned msgpack manifest (`manifest`, sent with the
connection messages of `messages` through `codec`, bounded by `schema.Limits`) describes the
sequence — layout fingerprint, blocks and their prefix hashes, payload frames with xxh3 checksums
(`checksum`), and the state decode needs to continue — and raw payload frames follow, read
straight from pool memory (`export`), or re-blocked by the sender into the receiver's block size
(`export_reblock`), and written straight into blocks the receiver reserved all-or-nothing once
the manifest passed its checks (`importer`, `import_checks`, `import_landing`; a receiver staged
and re-blocked (`reblock`) for senders that did not), staged through pinned host buffers for
device pools (`staging`), with duplicate prefix blocks shared rather than sent (`blocks`), stale
epochs refused (`epochs`) and sender blocks leased until the ack (`lease`). Payloads under
`TransportConfig.inline_bytes` make one round trip: no dedupe query, the receiver shares what it
caches. Two transports follow one contract (`transport`): ZeroMQ control over tcp/ipc
(`zmq_sender`, `zmq_receiver`, `zmq_payload`, `zmq_handshake`, `zmq_wire`) with the payload on a
raw TCP/Unix data stream (`stream_wire`, `stream_sender`, `stream_receiver`) or in ZeroMQ frames,
and Ray (`ray_transport`). A streamed migration offers a sequence while its prompt is still being
computed (`stream_export`; over Ray: `ray_stream`, `ray_stream_receiver`). `faults` injects the
chaos benchmark's transfer faults on the sending side. Every failure is a typed
`errors.TransferError`, counted in `metrics`, and leaves the receiver's pool unchanged. The
migration benchmark (`pdserve bench migrate`) and its synthetic pools live in the top-level
`bench` package, which nothing here imports.

Entry points for workers: `export_sequence` / `import_sequence` (in process), `ImportSession`
(driven chunk by chunk), `ZmqSender.migrate` / `ZmqReceiver.poll`, `RaySender.migrate` /
`RayReceiverEndpoint`.
"""

from transfer.errors import TransferError
from transfer.export import ExportConfig, ExportedSequence, export_sequence
from transfer.importer import ImportResult, ImportSession, import_sequence
from transfer.messages import PROTOCOL_VERSION, DecodeState, Manifest
from transfer.schema import Limits
from transfer.transport import TransportConfig, migrate

__all__ = ["TransferError", "ExportConfig", "ExportedSequence", "export_sequence", "ImportResult",
           "ImportSession", "import_sequence", "PROTOCOL_VERSION", "DecodeState", "Manifest", "Limits",
           "TransportConfig", "migrate"]

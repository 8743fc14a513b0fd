"""The transports: one entry file per transport holding both of its sides and the registry's
factories (`zmq`, `ray`, `nixl`; `transfer.registry` names them), and the helpers each entry
re-exports or uses, named after it (`zmq_channel`, `zmq_receiver`, `zmq_handshake`, `zmq_peers`
and the bulk link `bulk_wire`, `bulk_open`, `bulk_sender`, `bulk_receiver`; `ray_channel`,
`ray_receiver`; `nixl_api`, `nixl_pool`, `nixl_segments`). `message_channel` is what the ZeroMQ
and Ray sending channels share. The protocol itself is not here: `transfer.session` and
`transfer.receiver` (sans-IO), over the wire of `transfer.wire`.
"""

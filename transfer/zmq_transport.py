"""ZeroMQ transport (tcp:// and ipc://): `ZmqSender` on the prefill side, `ZmqReceiver` on the
decode side, both following the contract in `transfer.transport`; wire format in
`transfer.zmq_wire`.
"""

from transfer.zmq_channel import ZmqSender
from transfer.zmq_receiver import ZmqReceiver

__all__ = ["ZmqReceiver", "ZmqSender"]

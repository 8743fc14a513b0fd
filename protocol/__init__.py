"""Types every layer shares, at the bottom of the import graph and free of torch: the sampling
parameters (`sampling`), the worker protocol's typed commands and events (`messages`), their one
msgpack codec (`codec`) and the typed ZeroMQ push/pull queues that carry them (`queues`).
"""

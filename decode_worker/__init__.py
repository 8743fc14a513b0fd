"""Decode worker (`worker.DecodeWorker`, run as a Ray actor): receives migrations on a ZeroMQ or
Ray transport endpoint, commits only imports whose epoch the coordinator registered, joins them
to its continuous batch (`role='decode'` engine) and pushes the new tokens of each step to the
coordinator as one msgpack message. `colocated.ColocatedWorker` is the same worker doing both
phases (prompt and generation in one engine): the baseline the disaggregated cluster is
compared against, behind the same coordinator (`pdserve up --colocated K`).
"""

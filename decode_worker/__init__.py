"""Decode worker (`worker.DecodeWorker`, a Ray actor on the worker runtime): its role handler
(`handler`) receives migrations on a ZeroMQ or Ray transport endpoint, admits only transfers a
live reservation names (`credits`: credit-based backpressure and admission), joins committed
imports to its continuous batch (`role='decode'` engine) and reports each step's tokens.
`colocated` is the same runtime doing both phases in one engine: the baseline the disaggregated
cluster is compared against (`pdserve up --colocated K`, and `pdserve serve` in process).
"""

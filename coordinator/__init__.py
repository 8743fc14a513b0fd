"""The coordinator: the OpenAI-compatible HTTP API (`http`, `completion`, `protocol`, `chat`,
`detokenize`), the backend contract it serves from (`backend`, with the in-process engine), the
Ray cluster backend, split into a core that decides without I/O (`state`: the one shared state and
the actions; `core`: routing, admission, reports, failover; `membership`: joins, replacements,
drains, scales) and a driver that does the I/O (`cluster`, `lifecycle`, `drain`, `tasks`; with
`config` and `workers`), the ownership ledger and its reconciliation against worker reports
(`ledger`, `reconcile`), routing (`router`) and Prometheus metrics (`metrics`). It never touches
tensors and loads without torch.
"""

"""The coordinator: the OpenAI-compatible HTTP API (`http`, `completion`, `protocol`, `chat`,
`detokenize`), the backend contract it serves from (`backend`, with the in-process engine), the
Ray cluster backend (`cluster`, `config`, `workers`, `reports`, `failover`), the ownership ledger
and its reconciliation against worker reports (`ledger`, `reconcile`), routing (`router`) and
Prometheus metrics (`metrics`). It never touches tensors and loads without torch.
"""

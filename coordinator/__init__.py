"""The coordinator: the OpenAI-compatible HTTP API (`http`, `protocol`, `detokenize`), the backend
contract it serves from (`backend`, with an in-process engine implementation), Prometheus
metrics (`metrics`), the ownership ledger that records which worker owns each request's blocks at
which epoch (`ledger`), and the routing policies (`router`). It never touches tensors.
"""

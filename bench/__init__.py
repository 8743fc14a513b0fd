"""Benchmarks, the allocator-policy simulator, the serving load generator, their plots and the
demo driver: everything `pdserve bench ...`, `pdserve simulate` and `pdserve demo` run, and the
synthetic KV pools the tests share. It sits at the top of the import graph: it may import any
runtime package (kvcache, engine, transfer, coordinator, deploy), while nothing in the runtime
imports it; only `pdserve_cli` and `tests/` do. `migrate*`, `baselines`, `pools` and
`ray_receiver` measure KV migration; `allocator` the block allocator; `engine` the engine against
transformers; `kernels` the Triton attention kernels; `loadgen` and `serve*` disaggregated against
colocated serving; `sim/` is the simulator.
"""

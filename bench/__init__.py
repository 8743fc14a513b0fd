"""Benchmarks, their plots and the results report: what `pdserve bench ...` runs, and nothing
else. It sits at the top of the import graph: it may import any product package (the runtime,
deploy, and `measure`, whose serving and migration measurements `bench serve` and `bench migrate`
report), while nothing in the product imports it; only the CLI's `bench` commands
(pdserve_cli/cmd_bench_*.py) and `tests/` do. `baselines` is what `bench migrate` compares KV
migration against; `allocator` measures the block allocator; `engine` the engine against
transformers; `kernels` the Triton attention kernels; `chaos`, `fuzz`, `flood` and `soak` the
service's reliability.
"""

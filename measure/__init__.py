"""Measurements of a running pdserve, shared by a product feature and the benchmarks: the planner's
`pdserve profile` and `pdserve plan --validate` measure with it, and `pdserve bench serve` /
`bench migrate` report it. `serve` serves one or more configurations under open-loop load
(`loadgen` makes the requests, `serve_client` sends them from a child process, `serve_metrics`
summarises the client's records, `serve_slo` scales the SLOs, `serve_goodput` searches the
highest rate that meets them, `serve_trace` and `traces/` replay a Mooncake trace, `serve_mixed`
shares prefixes, `serve_report` prints and plots); `migrate` times KV migration pool to pool
through a peer process (`migrate_peer`, `migrate_endpoints`, `ray_receiver`) over synthetic pools
(`pools`); `machine` describes where it ran. It may import any runtime package and `deploy`;
only the planner, bench/, the CLI and tests import it.
"""

"""Prefill worker (cluster issue, not built yet): a Ray actor running the engine in prefill-only
mode; it fills its pool with a prompt's KV, samples the first token, exports the blocks to the
decode worker the coordinator chose, and holds them under a lease until the decode side
acknowledges.
"""

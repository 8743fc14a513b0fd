"""Prefill worker (`worker.PrefillWorker`, run as a Ray actor): a `role='prefill'` engine stepped by
a background thread; for each request it fills its pool with the prompt's KV, pushes the first
token to the coordinator, migrates every sequence's blocks to the decode worker the coordinator
chose (over `transfer/`, under the coordinator's epoch) and releases them once acknowledged;
full blocks stay in its prefix cache.
"""

"""Prefill worker (`worker.PrefillWorker`, a Ray actor on the worker runtime): its role handler
(`handler`) runs each prompt through a `role='prefill'` engine, reports the first token, migrates
every sequence's blocks to the decode worker the coordinator reserved (over `transfer/`, under
the coordinator's epoch) and releases them once acknowledged, or holds them for a resend when a
migration fails; full blocks stay in its prefix cache.
"""

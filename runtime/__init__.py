"""The worker runtime every role runs on: one engine loop (`loop`) and one Ray actor body with a
typed command entry point (`actor`). Role handlers live in prefill_worker/ and decode_worker/.
"""

"""Decode worker (cluster issue, not built yet): a Ray actor that reserves blocks for incoming
migrations, imports them into its own pool, joins them to its continuous batch and streams tokens
back to the coordinator once per step.
"""

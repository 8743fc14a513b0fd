"""Mooncake-format traces shipped with the serving benchmark (bench.serve_trace reads them) and the
generator that made them (`python -m bench.traces.generate`)."""

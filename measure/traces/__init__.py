"""Mooncake-format traces shipped with the serving benchmark (measure.serve_trace reads them) and the
generator that made them (`python -m measure.traces.generate`)."""

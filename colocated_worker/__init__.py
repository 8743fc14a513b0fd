"""The colocated worker: one engine runs both phases of every request and no KV moves (the
baseline every disaggregated result is compared with)."""

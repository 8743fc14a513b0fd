"""What a worker reports holding: device blocks per request, for the coordinator's ledger.

Each used block is counted once, under the first request (in id order) whose tables name it:
two live requests sharing a cached prefix do not count it twice, so the values add up to the
pool's `used_blocks` exactly when no block is held outside a live request (a leak). Swapped-out
sequences hold host blocks, not device blocks, and count 0.
"""

from __future__ import annotations


def blocks_by_request(engine, requests: dict, request_of=lambda key: key,
                      landing: dict | None = None) -> dict[str, int]:
    """requests: engine request id -> Request; request_of maps an engine request id (or a transfer
    id) to the id the coordinator knows (a decode worker runs choice i of request R as 'R/i').
    landing: transfer id -> blocks reserved by imports not committed yet (they are used too)."""
    tables, seen, out = engine.kv.tables, set(), {}
    landing = landing or {}
    for key in sorted(set(requests) | set(landing)):
        rid = request_of(key)
        blocks = set(landing.get(key, ()))
        for seq in requests[key].seqs if key in requests else ():
            t = tables.get(seq.seq_id)
            if t is not None and not t.swapped:
                blocks.update(t.blocks)
        blocks -= seen
        seen |= blocks
        out[rid] = out.get(rid, 0) + len(blocks)
    return out

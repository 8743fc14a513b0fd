"""End to end on a local Ray with `disaggregate='auto'` (coordinator.decide): a short prompt is
prefilled on the decode worker itself, a long one on the prefill worker and migrated, and the
same long prompt again on the decode worker, whose prefix cache holds most of it by then. Every
path gives the in-process engine's greedy tokens; the response's `pdserve.backend.path` and
/metrics (`pdserve_requests_by_path_total`) say which path each took and why, and the ledger
comes to rest with nothing held. With no prefill_ms_per_token configured, the decode worker's
startup timing prices its local prefills once a migration has been measured.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("ray")

import cluster_client as cc  # noqa: E402

from coordinator.cluster import ClusterConfig  # noqa: E402
from deploy.launch import ClusterServer  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SHORT = list(range(1, 11))                          # 10 uncached tokens <= 24: local
LONG = [(7 * i) % 200 + 3 for i in range(60)]      # 60 uncached > 24: disaggregated
# the decode worker caches LONG's first 3 full blocks (48 tokens) after it: 12 uncached, local


def test_both_paths_give_the_local_engines_tokens_and_say_so(ray_local, local_engine):
    config = ClusterConfig(num_blocks=128, block_size=16, disaggregate="auto", local_prefill_max_tokens=24)
    srv = ClusterServer(config)
    try:
        srv.start()
        want = cc.reference(local_engine, [SHORT, LONG], SamplingParams(max_tokens=8, ignore_eos=True))
        paths = []
        for prompt, ref in ((SHORT, want[0]), (LONG, want[1]), (LONG, want[1])):
            body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            got = cc.complete(srv.port, body)
            assert [c["token_ids"] for c in got["choices"]] == ref
            backend = got["pdserve"]["backend"]
            paths.append((backend["path"]["path"], backend["path"]["reason"], backend["prefill_worker"],
                          backend["migration"] is not None))
        assert paths[:2] == [
            ("local_prefill", "uncached 10 tokens <= 24", "decode-0", False),
            ("disaggregate", "uncached 60 tokens > 24", "prefill-0", True),
        ]
        # once a migration was measured, the limit is what the decode worker prefills in one: its prefill
        # ms per token timed at its startup (engine.warmup.startup_profile), none configured here
        startup = cc.workers(srv.port)["decode-0"]["startup"]
        assert startup["prefill_ms_per_token"] > 0 and startup["prefill_tokens"] > 0
        m = re.fullmatch(r"uncached 12 tokens <= (\d+), 48 cached on decode", paths[2][1])
        assert m and int(m[1]) >= 24
        assert (paths[2][0], paths[2][2], paths[2][3]) == ("local_prefill", "decode-0", False)
        metrics = cc.get(srv.port, "/metrics").decode()
        assert 'pdserve_requests_by_path_total{path="local_prefill",reason="short_uncached"} 2.0' in metrics
        assert 'pdserve_requests_by_path_total{path="disaggregate",reason="long_uncached"} 1.0' in metrics
        info = cc.wait_at_rest(srv.port)
        assert info["ledger"]["active_requests"] == 0 and info["ledger"]["owned_blocks"] == 0
        assert cc.workers(srv.port)["decode-0"]["local_prefills"] == 2
    finally:
        srv.stop()

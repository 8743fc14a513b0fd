"""deploy/grafana/pdserve.json: a dashboard whose every panel queries metrics the coordinator's
/metrics really exports (here the HTTP app over the in-process tiny engine: the same Metrics
registry and per-worker families as a cluster's coordinator), so no panel stays empty because a
metric was renamed or never existed."""

import json
import re
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy/grafana/pdserve.json"
NAME = re.compile(r"\bpdserve_[a-z_]+\b")
SERIES_SUFFIXES = ("_bucket", "_sum", "_count", "_total")


def panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


def exported_names(text: str) -> set[str]:
    """Every family (from # TYPE lines) and series name in a Prometheus exposition."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def known(name: str, exported: set[str]) -> bool:
    if name in exported:
        return True
    return any(name.endswith(s) and name[: -len(s)] in exported for s in SERIES_SUFFIXES)


def test_dashboard_is_grafana_json_with_queries():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["panels"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert NAME.search(target["expr"]), (panel["title"], target["expr"])


def test_every_panel_metric_is_exported(http_server):
    status, body = http_server.get("/metrics")
    assert status == 200
    exported = exported_names(body.decode())
    missing = {(panel["title"], name) for panel in panels(json.loads(DASHBOARD.read_text()))
               for target in panel["targets"] for name in NAME.findall(target["expr"])
               if not known(name, exported)}
    assert not missing, f"panels query metrics /metrics does not export: {sorted(missing)}"


def test_a_renamed_metric_is_caught():
    exported = exported_names("# TYPE pdserve_requests_total counter\n"
                              "pdserve_requests_total{status=\"ok\"} 1\n"
                              "# TYPE pdserve_migration_bytes histogram\n")
    assert known("pdserve_requests_total", exported)
    assert known("pdserve_migration_bytes_sum", exported)
    assert not known("pdserve_request_total", exported)

"""Draining and scaling workers at run time (coordinator.drain, coordinator.admin), on one small
cluster behind an API key: the admin routes want the key; a decode worker drained while requests
stream through it lets them finish there (every answer the local engine's greedy tokens), then
leaves: out of /v1/cluster, its slot neither listed as empty nor replaced, no worker holding a
used block and the ledger at rest. Scaling decode 1 -> 2 adds a worker in a fresh slot that takes
requests after its handshakes; a busy decode worker drained with a zero timeout under load has its
requests moved (re-prefill on the other one): each answer right or a clean 5xx, never wrong; then
2 -> 1 again through `scale` under load, and the cluster at rest with no block held.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("ray")

import cluster_client as cc  # noqa: E402

from coordinator.cluster import ClusterConfig  # noqa: E402
from coordinator.http import HTTPConfig  # noqa: E402
from deploy.launch import ClusterServer  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

pytestmark = pytest.mark.timeout(300)
KEY = "drain-scale-key"
PROMPTS = [[(i * 7 + j) % 240 + 3 for j in range(10 + 3 * i)] for i in range(6)]
GREEDY = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}


def _call(port: int, path: str, body: dict | None = None, key: str | None = KEY, method: str = "POST"):
    """(status, JSON body) of one call to the coordinator."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data, headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _answer(port: int, prompt: list[int]):
    """The token ids, or the status of a clean failure."""
    status, body = _call(port, "/v1/completions", {"prompt": prompt, **GREEDY})
    return body["choices"][0]["token_ids"] if status == 200 else status


def _info(port: int) -> dict:
    return _call(port, "/v1/cluster", method="GET")[1]


def _under_load(port: int, action) -> tuple[list, object]:
    """Send every prompt at once, run `action()` once the ledger has requests in flight, then
    collect the answers."""
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = [pool.submit(_answer, port, p) for p in PROMPTS]
        while _info(port)["ledger"]["active_requests"] == 0 and not all(a.done() for a in answers):
            time.sleep(0.02)
        result = action()
        return [a.result(timeout=180) for a in answers], result


def _busy_decode(port: int, deadline_s: float = 10.0) -> str:
    """A decode worker that holds a request's blocks now (bounded; else any decode worker)."""
    end = time.monotonic() + deadline_s
    while True:
        decodes = [w for w in _info(port)["workers"] if w["role"] == "decode"]
        busy = [w["name"] for w in decodes if w["used_blocks"]]
        if busy or time.monotonic() > end:
            return (busy or [decodes[0]["name"]])[0]
        time.sleep(0.01)


def _at_rest(port: int, deadline_s: float = 20.0) -> dict:
    """/v1/cluster once no request is active and no worker holds a used block (bounded)."""
    end = time.monotonic() + deadline_s
    while True:
        info = _info(port)
        quiet = all(w["used_blocks"] == 0 for w in info["workers"] if w["alive"])
        if (info["ledger"]["active_requests"] == 0 and quiet) or time.monotonic() > end:
            return info
        time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(ray_local):
    config = ClusterConfig(prefill=1, decode=2, num_blocks=128, heartbeat_timeout_s=5.0)
    srv = ClusterServer(config, http_config=HTTPConfig(port=0, api_key=KEY))
    try:
        yield srv.start()
    finally:
        srv.stop()


def _check_rest(port: int) -> dict:
    info = _at_rest(port)
    assert info["ledger"]["active_requests"] == 0
    assert all(w["used_blocks"] == 0 and w.get("reserved_blocks", 0) == 0 for w in info["workers"]), \
        info["workers"]
    assert cc.ledger_differences(info) == {}
    return info


def test_admin_routes_want_the_key_and_refuse_what_cannot_be_done(cluster):
    port = cluster
    assert _call(port, "/v1/cluster/workers/decode-0/drain", {}, key=None)[0] == 401
    assert _call(port, "/v1/cluster/scale", {"decode": 3}, key="wrong")[0] == 401
    assert _call(port, "/v1/cluster/workers/nobody/drain", {})[0] == 404
    assert _call(port, "/v1/cluster/workers/prefill-0/drain", {})[0] == 409  # the last prefill worker
    assert _call(port, "/v1/cluster/scale", {"decode": 0})[0] == 400
    assert _call(port, "/v1/cluster/scale", {"colocated": 1})[0] == 400
    assert _call(port, "/v1/cluster/scale", {"decode": 2, "timeout_s": -1})[0] == 400


def test_drain_a_decode_worker_under_load(cluster, local_engine):
    port = cluster
    want = cc.reference(local_engine, PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    got, (status, result) = _under_load(port, lambda: _call(port, "/v1/cluster/workers/decode-0/drain", {}))
    assert status == 200, result
    print("drain:", result)
    assert got == [w[0] for w in want]  # every request answered, and right
    assert result["worker"] == "decode-0" and result["finished_in_place"] and result["moved"] == 0
    assert result["used_blocks_at_exit"] == 0
    info = _check_rest(port)
    names = {w["name"] for w in info["workers"]}
    assert "decode-0" not in names and "decode-0" not in info["empty_slots"]
    assert _call(port, "/health", method="GET")[0] == 200
    assert _call(port, "/v1/cluster/workers/decode-0/drain", {})[0] == 404  # gone, not replaced


def test_scale_decode_one_two_one(cluster, local_engine):
    port = cluster
    want = cc.reference(local_engine, PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    decodes = sorted(w["name"] for w in _info(port)["workers"] if w["role"] == "decode")
    assert decodes == ["decode-1"]  # after the drain above

    status, up = _call(port, "/v1/cluster/scale", {"decode": 2})
    assert status == 200 and up["errors"] == [] and up["added"] == ["decode-2"], up  # a fresh slot
    assert up["workers"]["decode"] == ["decode-1", "decode-2"]
    answers = [_answer(port, p) for p in PROMPTS]
    assert answers == [w[0] for w in want]
    assert _call(port, "/v1/cluster/scale", {"decode": 2})[1]["added"] == []  # already there

    def drain_a_busy_one():  # zero timeout: what it still runs moves (re-prefill on the other one)
        return _call(port, f"/v1/cluster/workers/{_busy_decode(port)}/drain", {"timeout_s": 0})

    got, (status, result) = _under_load(port, drain_a_busy_one)
    assert status == 200 and result["failed"] == 0, result
    print("drain, timeout 0:", result, "answers:", [a if isinstance(a, int) else "ok" for a in got])
    for answer, reference in zip(got, want):
        assert answer == reference[0] or answer in (500, 503, 504), (answer, reference[0])
    _check_rest(port)
    status, up = _call(port, "/v1/cluster/scale", {"decode": 2})
    assert status == 200 and up["errors"] == [] and len(up["added"]) == 1, up

    got, (status, down) = _under_load(port, lambda: _call(port, "/v1/cluster/scale",
                                                          {"decode": 1, "timeout_s": 0}))
    assert status == 200 and down["errors"] == [] and len(down["drained"]) == 1, down
    print("scale down:", down["drained"], "answers:", [a if isinstance(a, int) else "ok" for a in got])
    for answer, reference in zip(got, want):  # moved and right, or a clean failure: never wrong
        assert answer == reference[0] or answer in (500, 503, 504), (answer, reference[0])
    info = _check_rest(port)
    assert len([w for w in info["workers"] if w["role"] == "decode"]) == 1 and info["empty_slots"] == {}
    assert [_answer(port, p) for p in PROMPTS[:2]] == [w[0] for w in want[:2]]


def test_drain_and_scale_commands(cluster, tmp_path, monkeypatch, capsys):
    """`pdserve scale` and `pdserve drain` (pdserve_cli.cmd_scale, cmd_drain) against the same
    cluster: the key from $PDSERVE_API_KEY or --api-key-file, the server's answer printed as JSON,
    one-line errors with exit status 2."""
    from pdserve_cli.main import main

    url = f"http://127.0.0.1:{cluster}"

    def cli(*argv) -> tuple[int, str, str]:
        rc = main(list(argv))
        out, err = capsys.readouterr()
        return rc, out, err

    rc, _, err = cli("drain", "prefill-0", "--url", url)  # no key
    assert rc == 2 and err.startswith("pdserve drain: error: 401") and err.count("\n") == 1, err
    monkeypatch.setenv("PDSERVE_API_KEY", KEY)
    rc, _, err = cli("drain", "prefill-0", "--url", url)  # the last prefill worker
    assert rc == 2 and err.startswith("pdserve drain: error: 409") and err.count("\n") == 1, err
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    rc, out, err = cli("scale", "--decode", "2", "--url", url, "--api-key-file", str(key_file))
    assert rc == 0, err
    added = json.loads(out)["added"]
    assert len(added) == 1 and json.loads(out)["errors"] == [], out
    monkeypatch.setenv("PDSERVE_API_KEY", KEY)
    rc, out, err = cli("drain", added[0], "--url", url, "--timeout-s", "5")
    assert rc == 0, err
    result = json.loads(out)
    assert result["worker"] == added[0] and result["failed"] == 0 and result["used_blocks_at_exit"] == 0
    rc, _, err = cli("scale", "--url", url)
    assert rc == 2 and "give at least one" in err
    info = _check_rest(cluster)
    assert [w["name"] for w in info["workers"] if w["role"] == "decode"] != [added[0]]

"""Issue 49, item 4: the admin routes (drain, scale) are shut on a server without an API key
unless it was started with `--admin` (403 naming the flags otherwise), and take JSON bodies only
(415 for any other Content-Type, so no HTML form posted from a web page reaches them).
`pdserve drain` / `pdserve scale` print the server's 403, which names the flag to add. A fake
cluster backend stands in for the Ray one (coordinator.admin only needs its two methods)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest
from http_harness import serve

from coordinator.http import HTTPConfig
from pdserve_cli import cmd_serve_local as cmd_serve
from pdserve_cli import cmd_up

KEY = "admin-key"


class FakeCluster:
    """Records the drain and scale calls it gets (coordinator.admin.Scalable)."""

    def __init__(self):
        self.calls = []

    async def drain_worker(self, name: str, timeout_s: float | None = None) -> dict:
        self.calls.append(("drain", name, timeout_s))
        return {"worker": name}

    async def scale(self, targets: dict, timeout_s: float | None = None) -> dict:
        self.calls.append(("scale", targets, timeout_s))
        return {"added": [], "drained": [], "errors": []}


@pytest.fixture
def served(http_loop):
    started = []

    def start(config: HTTPConfig):
        backend = FakeCluster()
        server = serve(http_loop, backend, config)
        started.append(server)
        return server, backend

    yield start
    for server in started:
        asyncio.run_coroutine_threadsafe(server.runner.cleanup(), http_loop).result(30)


def _post(port: int, path: str, data: bytes | None, content_type: str | None, key: str | None = None):
    headers = {**({"Content-Type": content_type} if content_type else {}),
               **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data, headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


SCALE = "/v1/cluster/scale"
DRAIN = "/v1/cluster/workers/decode-0/drain"
BODY = json.dumps({"decode": 2}).encode()


def test_without_a_key_or_admin_the_routes_are_403_naming_the_flags(served):
    server, backend = served(HTTPConfig())
    for path in (SCALE, DRAIN):
        status, body = _post(server.port, path, BODY, "application/json")
        assert status == 403 and body["error"]["type"] == "permission_error", body
        assert "--admin" in body["error"]["message"] and "--api-key-file" in body["error"]["message"]
    assert backend.calls == []


def test_admin_opens_them_without_a_key(served):
    server, backend = served(HTTPConfig(admin=True))
    assert _post(server.port, SCALE, BODY, "application/json") == (200, {"added": [], "drained": [],
                                                                          "errors": []})
    assert _post(server.port, DRAIN, b"{}", "application/json; charset=utf-8")[0] == 200
    assert backend.calls == [("scale", {"decode": 2}, None), ("drain", "decode-0", None)]


def test_with_a_key_they_want_it(served):
    server, backend = served(HTTPConfig(api_key=KEY))
    assert _post(server.port, SCALE, BODY, "application/json")[0] == 401
    assert _post(server.port, SCALE, BODY, "application/json", key=KEY)[0] == 200
    assert backend.calls == [("scale", {"decode": 2}, None)]


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_json_bodies_only(served, content_type):
    server, backend = served(HTTPConfig(api_key=KEY))
    for path, data in ((SCALE, BODY), (DRAIN, b"")):
        status, body = _post(server.port, path, data, content_type, key=KEY)
        assert status == 415 and "application/json" in body["error"]["message"], body
    assert backend.calls == []


@pytest.mark.parametrize("argv", [["drain", "decode-0"], ["scale", "--decode", "2"]])
def test_the_cli_says_which_flag_to_add(served, argv, capsys, monkeypatch):
    from pdserve_cli.main import main

    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    server, backend = served(HTTPConfig())
    rc = main([*argv, "--url", server.url])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"pdserve {argv[0]}: error: 403") and err.count("\n") == 1, err
    assert "--admin" in err and "--api-key-file" in err
    assert backend.calls == []


@pytest.mark.parametrize("command", [cmd_up, cmd_serve])
def test_up_and_serve_take_admin(command):
    import argparse

    p = argparse.ArgumentParser()
    command.add_arguments(p)
    assert p.parse_args(["--admin"]).admin is True
    assert not p.parse_args([]).admin


def test_up_passes_admin_into_the_http_config(tmp_path):
    """`pdserve up --admin` (or `admin: true` in its --config file) reaches HTTPConfig."""
    import argparse

    p = argparse.ArgumentParser()
    cmd_up.add_arguments(p)
    assert cmd_up._settings(p.parse_args(["--admin"]))[1] == {"admin": True}
    assert cmd_up._settings(p.parse_args([]))[1] == {}
    config = tmp_path / "up.yaml"
    config.write_text("admin: true\n")
    assert cmd_up._settings(p.parse_args(["--config", str(config)]))[1] == {"admin": True}

"""The chaos benchmark's hostile-input phase (issue 28): requests and handshakes that must cost their
sender a 4xx or a refusal and never a worker, sent while the phase's ordinary load is in flight.

HTTP kinds, each sent `REPEATS` times as raw bytes on a fresh connection: a lone surrogate in
`stop` and in a text prompt, `top_k: 10**30`, JSON nested 200k deep (in a completion's prompt and
in a chat message), non-UTF-8 bytes in `Authorization`. Each is counted as 2xx / 4xx / 5xx /
no response. KV kinds, sent from a ZeroMQ DEALER to a decode worker's KV address without the
cluster secret: a hello whose `tag` is a non-ASCII string (fresh timestamp, random nonce), hellos
whose msgpack body is 8 MiB, a query before any hello, and garbage frames; each counted as sent /
answered. Then, after `settle_s` (a heartbeat timeout and a bit, so a loop that died is noticed),
`/v1/cluster` is compared with the snapshot taken before: every worker still there with the same
name and pid (none restarted), no role with fewer live workers (no empty slot), `/health` 200.
`failures` = 5xx + no response + workers restarted + empty slots + (health not 200); the phase
passes only at 0.
"""

from __future__ import annotations

import http.client
import secrets
import time

REPEATS = 5
DEEP = 200_000
_PROMPT = b'"prompt":[72,105],"max_tokens":4'
HTTP_KINDS = {  # name -> (path, body bytes, extra headers)
    "stop_lone_surrogate": ("/v1/completions", b'{%s,"stop":["\\ud800"]}' % _PROMPT, {}),
    "prompt_lone_surrogate": ("/v1/completions", b'{"prompt":"hi \\ud800","max_tokens":4}', {}),
    "top_k_huge": ("/v1/completions", b'{%s,"top_k":%d}' % (_PROMPT, 10**30), {}),
    "json_nested_deep": ("/v1/completions", b'{"prompt":' + b"[" * DEEP + b"]" * DEEP + b"}", {}),
    "chat_nested_deep": ("/v1/chat/completions", b'{"max_tokens":4,"messages":[{"role":"user","content":'
                         + b"[" * DEEP + b"]" * DEEP + b"}]}", {}),
    "authorization_not_utf8": ("/v1/completions", b"{%s}" % _PROMPT,
                               {"Authorization": b"Bearer \xff\xfe\xc3("}),
}
KV_KINDS = ("hello_tag_not_ascii", "hello_oversized", "query_before_hello", "garbage")


def _request(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
             timeout_s: float = 30.0) -> int:
    """The HTTP status (0: no response within the bound or the connection cut)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.putrequest(method, path)
        extra = {} if body is None else {"Content-Type": "application/json", "Content-Length": str(len(body))}
        for k, v in {**extra, **(headers or {})}.items():
            conn.putheader(k, v)
        conn.endheaders(body)
        resp = conn.getresponse()
        resp.read()
        return resp.status
    except (OSError, http.client.HTTPException):
        return 0
    finally:
        conn.close()


def _bucket(status: int) -> str:
    return "no_response" if status == 0 else f"{status // 100}xx"


def send_http(port: int, repeats: int = REPEATS) -> dict:
    out = {}
    for name, (path, body, headers) in HTTP_KINDS.items():
        counts: dict = {"2xx": 0, "4xx": 0, "5xx": 0, "no_response": 0}
        for _ in range(repeats):
            b = _bucket(_request(port, "POST", path, body, headers))
            counts[b] = counts.get(b, 0) + 1
        out[name] = counts
    return out


def _kv_messages(kind: str, fingerprint: dict, to: str) -> list[list[bytes]]:
    import msgpack

    from transfer.wire_codec import encode
    from transfer.wire_messages import PROTOCOL_VERSION, Hello

    if kind == "hello_tag_not_ascii":
        return [[b"H", encode(Hello(dict(fingerprint), "prefill-0", time.time(), secrets.token_hex(16),
                                    "\u00e9\u4e2d" * 32, to=to))] for _ in range(REPEATS)]
    if kind == "hello_oversized":
        big = msgpack.packb({"v": PROTOCOL_VERSION, "kind": "hello", "fingerprint": [0] * (8 << 20)})
        return [[b"H", big] for _ in range(2)]
    if kind == "query_before_hello":
        return [[b"Q", msgpack.packb({"v": PROTOCOL_VERSION, "kind": "query", "hashes": list(range(1000))})]]
    return [[secrets.token_bytes(n)] for n in (1, 7, 4096)] + [[b"H", secrets.token_bytes(2048)],
                                                               [b"M" + secrets.token_bytes(8), b"x", b"y"]]


def send_kv(address: str, fingerprint: dict, to: str, wait_s: float = 1.0) -> dict:
    """Each kind from its own DEALER: messages sent (without blocking) and replies seen. A decode
    worker reached by Ray calls has no socket to hit ({} then: the same receiver code is hit over
    ZeroMQ by the zmq and nixl transports)."""
    import zmq

    out = {}
    if not address.startswith(("tcp://", "ipc://")):
        return out
    ctx = zmq.Context()
    try:
        for kind in KV_KINDS:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDTIMEO, 2000)
            sent = answered = 0
            try:
                sock.connect(address)
                for msg in _kv_messages(kind, fingerprint, to):
                    try:
                        sock.send_multipart(msg)
                        sent += 1
                    except zmq.Again:
                        break
                end = time.monotonic() + wait_s
                while time.monotonic() < end:
                    if sock.poll(100):
                        sock.recv_multipart()
                        answered += 1
            finally:
                sock.close(0)
            out[kind] = {"sent": sent, "answered": answered}
    finally:
        ctx.term()
    return out


def _workers(info: dict) -> dict[str, tuple[str, int]]:
    return {w["name"]: (w["role"], w.get("pid")) for w in info["workers"] if w["alive"]}


def hostile_input(t) -> dict:
    """The phase's injector (bench.chaos_faults.Target): the detail dict, with `hostile` and
    `failures` (see the module docstring)."""
    from bench.chaos_faults import cluster_info, live

    info = cluster_info(t.port)
    before = _workers(info)
    decode = live(info, "decode")[0]
    http_counts = send_http(t.port)
    kv_counts = send_kv(decode["address"], t.fingerprint, decode["name"])
    time.sleep(getattr(t, "settle_s", 5.0))
    after = _workers(cluster_info(t.port))
    restarted = sorted(n for n, w in before.items() if after.get(n) != w)
    roles_before = [r for r, _ in before.values()]
    roles_after = [r for r, _ in after.values()]
    empty = sum(max(0, roles_before.count(r) - roles_after.count(r)) for r in set(roles_before))
    health = _request(t.port, "GET", "/health", timeout_s=10)
    bad_http = sum(c["5xx"] + c["no_response"] for c in http_counts.values())
    failures = bad_http + len(restarted) + empty + (health != 200)
    return {"hostile": {"http": http_counts, "kv": kv_counts, "kv_target": decode["name"],
                        "workers_restarted": restarted, "empty_slots": empty, "health_after": health,
                        "failures": failures}}


def hostile_summary(entries: list[dict]) -> dict | None:
    """The report's top-level `hostile`: the phase's counts, or None when the phase did not run."""
    found = [e["detail"]["hostile"] for e in entries if "hostile" in e.get("detail", {})]
    return found[-1] if found else None

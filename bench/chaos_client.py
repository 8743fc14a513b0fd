"""The chaos benchmark's HTTP client and its verdicts: one request to the coordinator (streamed or
not, optionally walking away mid-stream like a client that disconnects) and the classification of
what came back against the local engine's tokens.

`send` never raises: it returns an `Outcome` (how the request ended, the token ids per choice it
saw, the HTTP status, the error text). `classify` turns an outcome and the reference into one of
"correct", "failed_clean" (an error the client saw: an HTTP error status or an error event in the
stream, with every token seen before it a prefix of the reference) or "wrong" (tokens that differ
from the reference, or a request that ended with neither an answer nor an error: a hang past the
client's bound, a connection cut without an error event). A client that walks away on purpose is
"correct" when the tokens it got are a prefix of the reference.
"""

from __future__ import annotations

import http.client
import json
import socket
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ChaosRequest:
    """One request of the load: prompt ids, the completion body's sampling fields, whether it is
    streamed, and (streamed only) after how many data chunks the client walks away (0: never)."""

    index: int
    prompt: list[int]
    params: dict
    stream: bool = False
    disconnect_after: int = 0

    def body(self) -> dict:
        return {"prompt": self.prompt, **self.params, "stream": self.stream}


@dataclass
class Outcome:
    end: str                      # "answer", "error", "disconnected", "unclean"
    tokens: dict = field(default_factory=dict)  # choice index -> token ids seen
    status: int = 0
    error: str = ""


def _read_stream(resp, req: ChaosRequest, conn) -> Outcome:
    out = Outcome("unclean", status=resp.status)
    chunks = 0
    for raw in resp:
        line = raw.decode(errors="replace").strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            if out.end == "unclean":
                out.end = "answer"
            return out
        chunk = json.loads(line[6:])
        if "error" in chunk:
            out.end, out.error = "error", str(chunk["error"].get("message", chunk["error"]))
            continue
        for c in chunk.get("choices", []):
            out.tokens.setdefault(c["index"], []).extend(c.get("token_ids") or [])
        chunks += 1
        if req.disconnect_after and chunks >= req.disconnect_after:
            out.end = "disconnected"
            conn.sock.shutdown(socket.SHUT_RDWR)  # walk away: the coordinator sees the socket close
            conn.close()
            return out
    out.error = out.error or "stream ended without [DONE]"
    return out


def send(port: int, req: ChaosRequest, timeout_s: float) -> Outcome:
    """POST /v1/completions on loopback; the outcome, never an exception."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", json.dumps(req.body()), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            data = resp.read()
            try:
                msg = json.loads(data)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = data[:200].decode(errors="replace")
            return Outcome("error", status=resp.status, error=msg)
        if req.stream:
            return _read_stream(resp, req, conn)
        body = json.loads(resp.read())
        tokens = {c["index"]: list(c["token_ids"]) for c in body["choices"]}
        return Outcome("answer", tokens, resp.status)
    except (OSError, http.client.HTTPException, ValueError) as e:  # timeouts are OSErrors
        return Outcome("unclean", error=f"{type(e).__name__}: {e}")
    finally:
        conn.close()


def classify(outcome: Outcome, reference: list[list[int]]) -> str:
    """'correct', 'failed_clean' or 'wrong' (see the module docstring)."""
    n = len(reference)
    if any(not 0 <= i < n for i in outcome.tokens):
        return "wrong"
    if outcome.end == "answer":
        return "correct" if [outcome.tokens.get(i, []) for i in range(n)] == reference else "wrong"
    prefixes = all(reference[i][:len(t)] == t for i, t in outcome.tokens.items())
    if outcome.end == "error":
        return "failed_clean" if prefixes else "wrong"
    if outcome.end == "disconnected":
        return "correct" if prefixes else "wrong"
    return "wrong"  # neither an answer nor an error the client saw

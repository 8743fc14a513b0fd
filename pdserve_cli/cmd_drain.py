"""`pdserve drain WORKER`: a thin client of `POST /v1/cluster/workers/WORKER/drain` on a running
coordinator (`--url`, default http://127.0.0.1:8000). The worker leaves routing at once, finishes
what it holds (at most `--timeout-s`, the server's drain_timeout_s by default; then what is left
moves to another worker), and leaves. Prints the server's answer as JSON. The API key comes from
`--api-key-file F` or `$PDSERVE_API_KEY` (pdserve_cli.api_key), never the command line. Any
failure (unreachable, refused, 4xx/5xx) is one line on stderr and exit status 2. `request` is the
HTTP call that `pdserve scale` shares.
"""

from __future__ import annotations

import json
import sys
import urllib.parse

from pdserve_cli import api_key

NAME = "drain"
GROUP = None
HELP = "drain a worker of a running cluster: it stops taking work, finishes or moves what it holds, leaves"
DEFAULT_URL = "http://127.0.0.1:8000"
SLACK_S = 60.0  # the HTTP wait beyond the drain's own timeout (the worker's shutdown, a slow move)
SERVER_DEFAULT_DRAIN_S = 30.0  # coordinator.config drain_timeout_s, for the HTTP wait only


def add_common(p) -> None:
    p.add_argument("--url", default=DEFAULT_URL, help=f"base URL of the coordinator (default {DEFAULT_URL})")
    p.add_argument("--api-key-file", metavar="F",
                   help=f"read the API key from file F (default: ${api_key.ENV}; neither: no key sent)")
    p.add_argument("--timeout-s", type=float, metavar="T",
                   help="how long a drained worker may finish in place before its requests move "
                        "(default: the server's drain_timeout_s)")


def add_arguments(p) -> None:
    p.add_argument("worker", metavar="WORKER", help="worker name as GET /v1/cluster lists it (decode-0)")
    add_common(p)


def request(args, path: str, body: dict) -> dict:
    """POST `body` to `path` with the key; the JSON answer. ValueError with a one-line reason."""
    import urllib.error
    import urllib.request

    key = api_key.resolve(args)
    if args.timeout_s is not None:
        if not 0 <= args.timeout_s <= 3600:
            raise ValueError(f"--timeout-s must be in 0..3600, got {args.timeout_s:g}")
        body = {**body, "timeout_s": args.timeout_s}
    if not args.url.startswith(("http://", "https://")):
        raise ValueError(f"--url must start with http:// or https://, got {args.url!r}")
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(args.url.rstrip("/") + path, data=json.dumps(body).encode(), headers=headers,
                                 method="POST")
    wait = (SERVER_DEFAULT_DRAIN_S if args.timeout_s is None else args.timeout_s) + SLACK_S
    try:
        with urllib.request.urlopen(req, timeout=wait) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        raise ValueError(f"{e.code}: {str(message).splitlines()[0] if message else e.reason}") from None
    except urllib.error.URLError as e:
        raise ValueError(f"cannot reach {args.url}: {e.reason}") from None
    except (TimeoutError, OSError) as e:
        raise ValueError(f"no answer from {args.url} within {wait:g}s: {e}") from None
    except json.JSONDecodeError:
        raise ValueError(f"{args.url} did not answer JSON") from None


def fail(command: str, msg: str) -> int:
    print(f"pdserve {command}: error: {msg}", file=sys.stderr)
    return 2


def run(args) -> int:
    try:
        result = request(args, f"/v1/cluster/workers/{urllib.parse.quote(args.worker, safe='')}/drain", {})
    except ValueError as e:
        return fail(NAME, str(e))
    print(json.dumps(result, indent=1))
    return 0

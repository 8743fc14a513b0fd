"""`pdserve scale --prefill N --decode M`: a thin client of `POST /v1/cluster/scale` on a running
coordinator (`--url`). Each role named is brought to that many workers: new ones join routing after
the same handshakes as at start, the surplus leaves through the drain (`--timeout-s` per drain).
Prints the server's answer as JSON (added, drained, errors, the workers per role); exit status 1
when the answer lists errors. The API key and the one-line errors (exit 2) as `pdserve drain`.
"""

from __future__ import annotations

import json

from pdserve_cli import cmd_drain

NAME = "scale"
GROUP = None
HELP = "bring a running cluster to N prefill and M decode workers (added after handshakes, removed by drain)"


def add_arguments(p) -> None:
    p.add_argument("--prefill", type=int, metavar="N", help="prefill workers wanted")
    p.add_argument("--decode", type=int, metavar="M", help="decode workers wanted")
    p.add_argument("--colocated", type=int, metavar="K", help="colocated workers wanted")
    cmd_drain.add_common(p)


def run(args) -> int:
    targets = {role: getattr(args, role) for role in ("prefill", "decode", "colocated")
               if getattr(args, role) is not None}
    if not targets:
        return cmd_drain.fail(NAME, "give at least one of --prefill, --decode, --colocated")
    try:
        result = cmd_drain.request(args, "/v1/cluster/scale", targets)
    except ValueError as e:
        return cmd_drain.fail(NAME, str(e))
    print(json.dumps(result, indent=1))
    return 1 if result.get("errors") else 0

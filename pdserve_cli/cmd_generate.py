"""`pdserve generate`: one completion, in-process (`--local`) or from a running coordinator (`--url`).

Both paths print the same body the HTTP API returns with `--json`:
{"choices": [{"index", "text", "token_ids", "finish_reason"}], "usage": {...}, "system_fingerprint"}.
`--local` computes in the weight format `up` and `serve` would serve the model in
(pdserve_cli.weights_arg.resolve), so their greedy tokens agree; the fingerprint ('pdserve-bf16')
says which format computed the answer, and the text output names it on stderr.
Bad arguments exit with status 2 and a one-line message.
"""

from __future__ import annotations

import json
import sys

from pdserve_cli import weights_arg

NAME = "generate"
GROUP = None
HELP = "generate a completion in-process (--local) or through a running coordinator (--url)"
LOCAL_DEFAULT_MODEL = "smollm2"  # the same default as serve, up and demo


def add_arguments(p) -> None:
    p.add_argument("prompt", nargs="?", help="prompt text (or use --prompt-ids)")
    p.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--local", action="store_true", help="run the engine in this process (default)")
    where.add_argument("--url", help="base URL of a running coordinator, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", help="with --local: 'smollm2' (default: SmolLM2-135M-Instruct), 'tiny' "
                   "(a random test model), a Llama-family .gguf file or a Hugging Face checkpoint "
                   "directory (`pdserve models` lists where each is); with --url: the served model's "
                   "name (default: the server's)")
    p.add_argument("--device", default="cpu")
    weights_arg.add_argument(p)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--beam-width", type=int, default=1)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print the JSON body instead of text")


def _fail(msg: str) -> int:
    print(f"pdserve generate: error: {msg}", file=sys.stderr)
    return 2


def _prompt_ids(args) -> list[int] | None:
    if args.prompt_ids is None:
        return None
    try:
        return [int(x) for x in args.prompt_ids.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None


def run(args) -> int:
    if (args.prompt is None) == (args.prompt_ids is None):
        return _fail("give exactly one of PROMPT or --prompt-ids")
    if args.prompt is not None and not args.prompt:
        return _fail("prompt is empty")
    try:
        ids = _prompt_ids(args)
        if ids is not None and not ids:
            return _fail("--prompt-ids is empty")
        if args.url:
            body = _remote(args, ids)
        else:
            body = _local(args, ids)
    except (ValueError, OSError) as e:  # RequestError, bad sampling parameters, bad model spec
        return _fail(str(e).splitlines()[0])
    if args.json:
        print(json.dumps(body))
    else:
        for c in body["choices"]:
            prefix = f"[{c['index']}] " if len(body["choices"]) > 1 else ""
            print(f"{prefix}{c['text']}", flush=True)
        if body.get("system_fingerprint"):
            print(f"({body['system_fingerprint']})", file=sys.stderr)
    return 0


def _params(args):
    from engine.sampling import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), n=args.n,
                          beam_width=args.beam_width, ignore_eos=args.ignore_eos)


def _local(args, ids: list[int] | None) -> dict:
    from coordinator.completion import system_fingerprint
    from engine.engine import EngineConfig, LLMEngine

    params = _params(args)
    model = args.model or LOCAL_DEFAULT_MODEL
    config = EngineConfig(model=model, device=args.device, block_size=args.block_size,
                          weights=weights_arg.resolve(args.weights, args.device, model))
    engine = LLMEngine(config)
    if ids is None:
        ids = engine.tokenizer.encode(args.prompt)
    [done] = engine.generate([ids], params)
    completion = sum(len(c["token_ids"]) for c in done.choices)
    return {"choices": done.choices,
            "usage": {"prompt_tokens": len(ids), "completion_tokens": completion,
                      "total_tokens": len(ids) + completion},
            "system_fingerprint": system_fingerprint(engine.computes_in)}


def _remote(args, ids: list[int] | None) -> dict:
    import urllib.error
    import urllib.request

    params = _params(args)
    body = {"model": args.model or "", "prompt": ids if ids is not None else args.prompt,
            "max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k, "n": params.n, "stop": list(params.stop)}
    if args.seed is not None:
        body["seed"] = args.seed
    req = urllib.request.Request(args.url.rstrip("/") + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            out = json.loads(r.read())
    except urllib.error.HTTPError as e:
        msg = json.loads(e.read() or b"{}").get("error", {}).get("message", str(e))
        raise ValueError(f"server answered {e.code}: {msg}") from None
    except urllib.error.URLError as e:
        raise ValueError(f"cannot reach {args.url}: {e.reason}") from None
    return {"choices": [{k: c.get(k) for k in ("index", "text", "token_ids", "finish_reason")}
                        for c in out["choices"]], "usage": out.get("usage", {}),
            "system_fingerprint": out.get("system_fingerprint")}

"""What `pdserve up` can check before it starts Ray, so that a mistake costs a second, not the
10-30 s of a Ray start and a model load per worker: the HTTP port (bound and released), the model
(the checks the loader makes before it reads weights, as `generate --local` would) and a joined
cluster's address (reachable). Each failure is a `PreflightError` naming its cause.

The model checks that need no torch run here: a GGUF file's header, metadata and architecture
(model_files.gguf, numpy only), a checkpoint folder's config.json as JSON. The rest of the loader's
checks (the config's fields through ModelConfig, the safetensors files, the tokenizer) import
torch, which the coordinator's process never loads: they run in a child process
(`python -m deploy.preflight DIR`), bounded.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys

MODEL_CHECK_TIMEOUT_S = 120.0  # the child's bound (a torch import on a loaded machine)


class PreflightError(ValueError):
    """Something `pdserve up` would fail on later, found before Ray starts."""


def check_port(host: str, port: int) -> None:
    """The HTTP API can listen on host:port now (bound with SO_REUSEADDR, as the server binds, and
    closed at once); port 0 (any free port) always can. A port taken between this check and the
    server's bind is still reported there."""
    if not 0 <= port <= 65535:
        raise PreflightError(f"--port must be 0..65535, got {port}")
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise PreflightError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(address)
            except OSError as e:
                hint = " (another server holds it: choose another --port, or --port 0 for any free one)" \
                    if e.errno == errno.EADDRINUSE else ""
                raise PreflightError(f"cannot listen on {host}:{port}: {e.strerror}{hint}") from None


def check_address(address: str | None) -> None:
    """A joined cluster's HOST:PORT answers a TCP connection ('auto' and ray:// are left to Ray)."""
    if not address or address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise PreflightError(f"--address must be 'auto' or HOST:PORT, got {address!r}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as e:
        raise PreflightError(f"cannot reach the Ray cluster at {address}: {e.strerror or e}") from None


def check_model(spec: str, flag: str = "--model") -> None:
    """The model a worker would load passes the loader's checks (see the module docstring)."""
    from model_files.gguf import GGUFFile, is_gguf_spec, resolve_model_spec

    if spec == "tiny":
        return
    if is_gguf_spec(spec):
        try:
            GGUFFile(resolve_model_spec(spec)).hf_config()
        except (OSError, ValueError) as e:  # GGUFError is a ValueError; ModelNotInstalled an OSError
            raise PreflightError(str(e)) from None
        return
    config = os.path.join(spec, "config.json")
    if not os.path.isfile(config):
        raise PreflightError(f"{flag} must be 'smollm2', 'tiny', a .gguf file or a checkpoint directory "
                             f"with a config.json: {spec!r}")
    try:
        with open(config, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise PreflightError(f"{config} cannot be read as JSON: {e}") from None
    if not isinstance(data, dict):
        raise PreflightError(f"{config} holds a {type(data).__name__}, not a JSON object")
    _check_in_child(spec)


def _check_in_child(directory: str) -> None:
    try:
        out = subprocess.run([sys.executable, "-m", "deploy.preflight", directory], capture_output=True,
                             text=True, timeout=MODEL_CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise PreflightError(f"checking the model {directory} took over {MODEL_CHECK_TIMEOUT_S:g}s") from None
    if out.returncode != 0:
        said = [line for line in out.stdout.splitlines() if line.startswith("error: ")]
        last = (out.stderr.strip().splitlines() or ["no reason given"])[-1]
        why = said[-1][len("error: "):] if said else last
        raise PreflightError(why)


def loader_checks(directory: str) -> None:
    """What the loader checks of a checkpoint folder before it reads weights (needs torch)."""
    from engine.loader import checkpoint_files, read_config
    from model_files.tokenizer import load_tokenizer

    config_path = os.path.join(directory, "config.json")
    try:
        config = read_config(directory)
    except KeyError as e:
        raise ValueError(f"{config_path} has no {e.args[0]!r}, which this engine needs") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{config_path}: {type(e).__name__}: {e}") from None
    checkpoint_files(directory)
    load_tokenizer(directory, config)


def _main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("error: usage: python -m deploy.preflight CHECKPOINT_DIR")
        return 2
    try:
        loader_checks(argv[0])
    except Exception as e:  # noqa: BLE001 (every failure is the answer, named)
        text = " ".join(str(e).split())
        print(f"error: {text}" if argv[0] in text else f"error: {argv[0]}: {type(e).__name__}: {text}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

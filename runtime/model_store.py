"""The model reaches every node: a worker loads from its own node's path when the files are there,
otherwise from the copy the coordinator put in Ray's object store, written once per node into a
cache directory (a file lock makes the other workers of the node wait for it and reuse it).

The coordinator calls `publish(path)`: the checkpoint's files (a directory's regular files, or
one .gguf file) go into the object store once, under a digest of their names, sizes and
modification times. A worker calls `resolve(spec, published)` before it builds its engine and
gets back a local path plus where it came from ('local', 'object_store' or 'node_cache').
Named models ('tiny', 'smollm2') are not files: every node resolves them itself.
"""

from __future__ import annotations

import fcntl
import os
import tempfile

import xxhash

CACHE_ROOT = os.path.join(tempfile.gettempdir(), "pdserve-models")
DONE = ".complete"


def _files(path: str) -> dict[str, str]:
    """Relative name -> absolute path of the checkpoint's files."""
    if os.path.isfile(path):
        return {os.path.basename(path): path}
    return {name: os.path.join(path, name) for name in sorted(os.listdir(path))
            if os.path.isfile(os.path.join(path, name))}


def publish(path: str) -> dict | None:
    """Put a local checkpoint into the object store: {'digest', 'name', 'ref'}; None for a name."""
    import ray

    if not os.path.exists(path):
        return None
    files = _files(path)
    digest = xxhash.xxh3_64()
    for name, full in files.items():
        stat = os.stat(full)
        digest.update(f"{name}|{stat.st_size}|{stat.st_mtime_ns}|".encode())
    payload = {}
    for name, full in files.items():
        with open(full, "rb") as f:
            payload[name] = f.read()
    top = os.path.basename(path) if os.path.isfile(path) else ""
    return {"digest": digest.hexdigest(), "name": top, "ref": ray.put(payload)}


def resolve(spec: str, published: dict | None, prefer_local: bool = True) -> tuple[str, str]:
    """(local path to load, source). prefer_local=False fetches even when the path exists here
    (tests use it to take the object-store path on one machine)."""
    if published is None or (prefer_local and os.path.exists(spec)):
        return spec, "local"
    import ray

    directory = os.path.join(CACHE_ROOT, published["digest"])
    os.makedirs(directory, exist_ok=True)
    source = "node_cache"
    with open(os.path.join(CACHE_ROOT, published["digest"] + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # NOTE: one worker per node fetches; the rest wait here
        if not os.path.exists(os.path.join(directory, DONE)):
            for name, data in ray.get(published["ref"]).items():
                with open(os.path.join(directory, os.path.basename(name)), "wb") as f:
                    f.write(data)
            open(os.path.join(directory, DONE), "w").close()
            source = "object_store"
    path = os.path.join(directory, published["name"]) if published["name"] else directory
    return path, source

"""The model reaches every node: a worker loads from its own node's path when the files are there,
otherwise from the copy the coordinator put in Ray's object store, written once per node into a
private cache directory (a file lock makes the other workers of the node wait for it and reuse it).

The coordinator calls `publish(path)`: the checkpoint's files (a directory's regular files, or
one .gguf file) go into the object store once, with the sha256 of every file's bytes and a digest
over those. A worker calls `resolve(spec, published)` before it builds its engine and gets back a
local path plus where it came from ('local', 'object_store' or 'node_cache'). Named models
('tiny', 'smollm2') are not files: every node resolves them itself.

The cache lives in the user's own cache directory ($PDSERVE_MODEL_CACHE, else
$XDG_CACHE_HOME/pdserve/models, else ~/.cache/pdserve/models), never in a shared temp folder that
another local user could pre-create. Every directory of it is created 0700 and checked through an
open descriptor (owned by this uid, a real directory, no group/other bits), and so is every folder
above it (owned by this uid or root, and writable by no one else unless sticky, as /tmp is: a
world-writable parent owned by another user could swap the cache for its own); every file is opened
relative to that descriptor with O_NOFOLLOW, new ones are written under a fresh O_EXCL temp name
and renamed into place, and the bytes are checked against the published sha256 before the
worker loads them, also when another worker of the node wrote them earlier. Anything else is a
`ModelStoreError` naming the path, and nothing outside the cache is opened for writing.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import secrets
import stat
from collections.abc import Callable

DONE = ".complete"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class ModelStoreError(RuntimeError):
    """The node's model cache is not private, holds something it should not, or a digest differs."""


def default_root() -> str:
    """The per-user cache directory of published models on this node."""
    if os.environ.get("PDSERVE_MODEL_CACHE"):
        return os.path.abspath(os.environ["PDSERVE_MODEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "pdserve", "models")


CACHE_ROOT = default_root()


def _files(path: str) -> dict[str, str]:
    """Relative name -> absolute path of the checkpoint's files."""
    if os.path.isfile(path):
        return {os.path.basename(path): path}
    return {name: os.path.join(path, name) for name in sorted(os.listdir(path))
            if os.path.isfile(os.path.join(path, name))}


def content_digest(files: dict[str, str]) -> str:
    """One sha256 over the sorted (name, sha256 of the bytes) pairs."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(f"{name}\0{files[name]}\n".encode())
    return h.hexdigest()


def publish(path: str) -> dict | None:
    """Put a local checkpoint into the object store: {'digest', 'name', 'files', 'ref'}, where
    files maps each name to the sha256 of its bytes; None for a named model."""
    import ray

    if not os.path.exists(path):
        return None
    payload, sums = {}, {}
    for name, full in _files(path).items():
        with open(full, "rb") as f:
            payload[name] = f.read()
        sums[name] = hashlib.sha256(payload[name]).hexdigest()
    top = os.path.basename(path) if os.path.isfile(path) else ""
    return {"digest": content_digest(sums), "name": top, "files": sums, "ref": ray.put(payload)}


def resolve(spec: str, published: dict | None, prefer_local: bool = True, root: str | None = None,
            fetch: Callable[[object], dict] | None = None) -> tuple[str, str]:
    """(local path to load, source). prefer_local=False fetches even when the path exists here
    (tests use it to take the object-store path on one machine); root overrides the cache dir;
    fetch turns published['ref'] into {name: bytes} (default: ray.get)."""
    if published is None or (prefer_local and _present(spec, published)):
        return spec, "local"
    root = root or default_root()
    digest, sums = _check_record(published)
    root_fd = open_private_dir(root)
    try:
        lock_fd = _open_file(root_fd, f"{digest}.lock", os.O_RDWR | os.O_CREAT, root)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX)  # NOTE: one worker per node fetches; the rest wait here
            source = _fill(root_fd, root, digest, sums, published, fetch)
        finally:
            os.close(lock_fd)
    finally:
        os.close(root_fd)
    directory = os.path.join(root, digest)
    return (os.path.join(directory, published["name"]) if published["name"] else directory), source


def _present(spec: str, published: dict) -> bool:
    """The published files are at `spec` on this node: the file itself, or every file of the
    directory (an empty directory, e.g. a mount point whose volume is missing, is not the model)."""
    if os.path.isfile(spec):
        return True
    names = published.get("files")
    return os.path.isdir(spec) and isinstance(names, dict) and bool(names) and all(
        isinstance(n, str) and os.path.isfile(os.path.join(spec, n)) for n in names)


def _check_record(published: dict) -> tuple[str, dict[str, str]]:
    digest, sums = published.get("digest"), published.get("files")
    if not isinstance(digest, str) or len(digest) != 64 or not isinstance(sums, dict) or not sums:
        raise ModelStoreError("published model record has no sha256 digest of its files")
    for name in sums:
        _check_name(name)
    if content_digest(sums) != digest:
        raise ModelStoreError("published model record's digest does not match its files' digests")
    return digest, sums


def _check_name(name: str) -> None:
    if (not isinstance(name, str) or not name or name in (".", "..", DONE) or "/" in name
            or "\0" in name or name.startswith(".tmp-") or name.endswith(".lock")):
        raise ModelStoreError(f"refusing model file name {name!r}")


def _fill(root_fd: int, root: str, digest: str, sums: dict[str, str], published: dict,
          fetch: Callable[[object], dict] | None) -> str:
    """Make root/digest hold exactly the published bytes; 'node_cache' when already there."""
    directory = os.path.join(root, digest)
    dir_fd = open_private_dir(directory, parent_fd=root_fd, name=digest)
    try:
        if _exists(dir_fd, DONE, directory):
            for name, want in sums.items():
                _verify(dir_fd, name, want, directory)
            return "node_cache"
        if fetch is None:
            import ray

            fetch = ray.get
        data = fetch(published["ref"])
        if set(data) != set(sums):
            raise ModelStoreError(f"object-store copy of the model has files {sorted(data)}, "
                                  f"the record names {sorted(sums)}")
        for name, want in sums.items():
            got = hashlib.sha256(data[name]).hexdigest()
            if got != want:
                raise ModelStoreError(f"digest mismatch for {name!r} from the object store: sha256 "
                                      f"{got}, published {want}")
            _write(dir_fd, name, data[name], directory)
        _write(dir_fd, DONE, digest.encode(), directory)
        return "object_store"
    finally:
        os.close(dir_fd)


CACHE_HINT = "set PDSERVE_MODEL_CACHE to a private directory"


def open_private_dir(path: str, parent_fd: int | None = None, name: str | None = None,
                     what: str = "model cache", hint: str = CACHE_HINT) -> int:
    """Create (0700) and open a directory this user alone can write; an fd checked with fstat.
    With parent_fd, `name` is created and opened relative to it (no path lookup outside);
    without, every folder above `path` is checked too (`unsafe_parent`). `what` and `hint` word
    the error: what the directory is for, and how to choose another."""
    if parent_fd is None:
        parent, name = os.path.split(os.path.abspath(path))
        os.makedirs(parent, mode=0o700, exist_ok=True)
        problem = unsafe_parent(parent)
        if problem:
            raise ModelStoreError(f"{what} {path} lies in {problem}, so another user could replace it; "
                                  f"refusing to use it ({hint})")
        parent_fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            return open_private_dir(path, parent_fd, name, what, hint)
        finally:
            os.close(parent_fd)
    try:
        os.mkdir(name, 0o700, dir_fd=parent_fd)
    except FileExistsError:
        pass
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as e:  # ELOOP: a symlink; ENOTDIR: a file
        raise ModelStoreError(f"{what} {path} is not a real directory ({e.strerror}); "
                              "refusing to use it") from None
    st = os.fstat(fd)
    problem = (f"owned by uid {st.st_uid}, not {os.geteuid()}" if st.st_uid != os.geteuid() else
               f"mode {stat.S_IMODE(st.st_mode):04o} lets group/other in" if st.st_mode & 0o077 else None)
    if problem:
        os.close(fd)
        raise ModelStoreError(f"{what} {path} is {problem}; refusing to use it (remove it, or {hint})")
    return fd


def unsafe_parent(directory: str) -> str | None:
    """The first folder from `directory` up to / that someone other than this user or root could
    change, described ("/srv/shared (uid 1001, mode 0777)"); None when there is none. A folder
    qualifies when another user owns it, or when group/other may write it without the sticky bit
    (with it, as on /tmp, others cannot rename or remove what is ours)."""
    me, path = os.geteuid(), os.path.realpath(directory)  # the folders that really hold it
    while True:
        st = os.stat(path)
        mode = stat.S_IMODE(st.st_mode)
        others_write = mode & 0o022 and not mode & stat.S_ISVTX
        if st.st_uid not in (me, 0) or others_write:
            return f"{path} (uid {st.st_uid}, mode {mode:04o})"
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent


def _open_file(dir_fd: int, name: str, flags: int, directory: str, mode: int = 0o600) -> int:
    path = os.path.join(directory, name)
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as e:
        raise ModelStoreError(f"cannot open {path} safely ({e.strerror}); a symlink or a foreign "
                              "file in the model cache is refused") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise ModelStoreError(f"{path} is not a regular file owned by this user; refusing it")
    return fd


def _exists(dir_fd: int, name: str, directory: str) -> bool:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode):
        raise ModelStoreError(f"{os.path.join(directory, name)} is not a regular file; refusing it")
    return True


def _verify(dir_fd: int, name: str, want: str, directory: str) -> None:
    """The cached file's bytes have the published sha256, read through an O_NOFOLLOW fd."""
    fd = _open_file(dir_fd, name, os.O_RDONLY, directory)
    h = hashlib.sha256()
    with os.fdopen(fd, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    if h.hexdigest() != want:
        raise ModelStoreError(f"digest mismatch for cached {os.path.join(directory, name)}: sha256 "
                              f"{h.hexdigest()}, published {want}; remove {directory} to fetch it again")


def _write(dir_fd: int, name: str, data: bytes, directory: str) -> None:
    """Write under a fresh temp name (O_CREAT | O_EXCL | O_NOFOLLOW), then rename over `name`;
    an existing symlink or non-file at `name` is refused, never followed."""
    _exists(dir_fd, name, directory)  # raises unless absent or a regular file
    tmp = f".tmp-{secrets.token_hex(8)}"
    fd = _open_file(dir_fd, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise

"""Where `pdserve up` and `pdserve serve` take the HTTP API key from, without putting it where other
local users can read it. A command line is public on a shared machine (`ps`, /proc/PID/cmdline,
Ray's job entrypoints), so the key comes from `--api-key-file F` (read and stripped; a warning
when the file is readable by group or other) or from `$PDSERVE_API_KEY`. `--api-key K` still
works, with a warning that says why not to. The variable is dropped from this process's
environment once read, so the Ray processes it starts (raylet, workers) do not inherit it.
`--admin` opens the admin routes (drain, scale) on a server without a key; with neither they
answer 403 (coordinator.admin).
"""

from __future__ import annotations

import os
import stat
import sys

ENV = "PDSERVE_API_KEY"
MAX_KEY_BYTES = 4096


def add_arguments(p) -> None:
    p.add_argument("--api-key-file", metavar="F", help="require 'Authorization: Bearer KEY' on every route "
                   f"but /health, KEY read from file F (default: ${ENV}; neither: no auth)")
    p.add_argument("--api-key", metavar="KEY", help=f"the same, KEY on the command line: discouraged, every "
                   f"local user sees it in `ps`; use --api-key-file or ${ENV}")
    # NOTE: default None, not False: `pdserve up` lets the flag override its --config file's `admin`
    p.add_argument("--admin", action="store_true", default=None, help="without an API key, open the admin "
                   "routes (drain, scale) anyway: any local process can then scale or drain the cluster "
                   "(default: they need the key, and are shut without one)")


def resolve(args, warn=None) -> str | None:
    """The API key (None: no auth). Raises ValueError with a one-line reason."""
    warn = warn or (lambda msg: print(f"warning: {msg}", file=sys.stderr, flush=True))
    on_line, path = getattr(args, "api_key", None), getattr(args, "api_key_file", None)
    from_env = os.environ.pop(ENV, None)  # NOTE: before any child process (Ray) is started
    if on_line is not None and path is not None:
        raise ValueError("give --api-key-file or --api-key, not both")
    if path is not None:
        key = read_key_file(path, warn)
    elif on_line is not None:
        warn(f"--api-key on the command line is visible to every local user (ps, /proc); "
             f"use --api-key-file F or ${ENV}")
        key = on_line
    else:
        key = from_env
    if key is None:
        return None
    key = key.strip()
    if not key:
        raise ValueError("the API key is empty")
    if len(key.encode("utf-8", "surrogateescape")) > MAX_KEY_BYTES or not key.isprintable():
        raise ValueError(f"the API key must be printable and at most {MAX_KEY_BYTES} bytes")
    return key


def read_key_file(path: str, warn) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"cannot read --api-key-file {path}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"--api-key-file {path} is not a regular file")
        if st.st_mode & 0o077:
            warn(f"--api-key-file {path} is readable by group or other (mode "
                 f"{stat.S_IMODE(st.st_mode):04o}); chmod 600 it")
        data = f.read(MAX_KEY_BYTES + 1)
    if len(data) > MAX_KEY_BYTES:
        raise ValueError(f"--api-key-file {path} is longer than {MAX_KEY_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"--api-key-file {path} is not UTF-8 text") from None

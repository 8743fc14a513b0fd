"""Pool memory that another process on the same machine can read: a file in /dev/shm mapped
MAP_SHARED. A prefill worker on the Ray transport keeps its KV pool here, so a decode worker on
the same node copies a migrated sequence's blocks straight out of it (one copy, no object store:
`transfer.pull`). The file is named `pdserve-kv-<pid>-<random>`, readable by its owner only,
and unlinked when the tensor is garbage-collected or the process exits; files left by a killed
process (whose pid is gone) are removed by the next allocation on the machine.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import uuid
import weakref

import torch

SHM_DIR = "/dev/shm"
PREFIX = "pdserve-kv-"


def shm_available() -> bool:
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def sweep_dead() -> None:
    """Remove pool files whose owning process no longer exists."""
    for name in os.listdir(SHM_DIR):
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name[len(PREFIX):].split("-", 1)[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM_DIR, name))
        except (ValueError, PermissionError):
            continue  # not ours to judge


def shm_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, str]:
    """A zero-filled tensor of `shape` backed by a new /dev/shm file, and the file's path."""
    sweep_dead()
    path = os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
    numel = math.prod(shape)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, numel * torch.empty((), dtype=dtype).element_size())  # zero-filled
    finally:
        os.close(fd)
    tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)
    unlink = weakref.finalize(tensor, _unlink, path)
    atexit.register(unlink)
    return tensor, path


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)

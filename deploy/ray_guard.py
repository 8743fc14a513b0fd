"""What keeps the Ray under pdserve closed to other machines and other local users. Anyone who can
reach a Ray node's GCS or raylet can run code on it, so: the embedded local Ray binds every one of
its servers (GCS, raylet, object manager, core workers, agents) to loopback, and runs with Ray's
token authentication (`RAY_AUTH_MODE=token`, Ray >= 2.52), which makes another local user without
the token unable to call it either; a joined multi-node cluster (`--address`) is expected to run
with token auth too, and `pdserve up` refuses to join without a token unless `RAY_AUTH_MODE` is set
to `disabled` explicitly. The token is Ray's own: `RAY_AUTH_TOKEN`, else the file named by
`RAY_AUTH_TOKEN_PATH`, else `~/.ray/auth_token` (`ray get-auth-token --generate` writes one; a local
Ray started with token auth and no token writes one there itself).
"""

from __future__ import annotations

import contextlib
import logging
import os

log = logging.getLogger(__name__)

AUTH_ENV = "RAY_AUTH_MODE"
AUTH_MODES = ("token", "disabled")
LOOPBACK = "127.0.0.1"


def auth_mode(default: str) -> str:
    """The Ray auth mode for this process: $RAY_AUTH_MODE when set, else `default`."""
    mode = (os.environ.get(AUTH_ENV) or default).strip().lower()
    if mode not in AUTH_MODES:
        raise ValueError(f"{AUTH_ENV} must be one of {AUTH_MODES}, got {mode!r}")
    return mode


def token_source() -> str | None:
    """Where Ray will read its token from, in Ray's own order; None when there is none."""
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return "$RAY_AUTH_TOKEN"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path:
        return path if _non_empty(path) else None
    default = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    return default if _non_empty(default) else None


def _non_empty(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return bool(f.read(4096).strip())
    except OSError:
        return False


def require_token(address: str) -> None:
    """Joining a cluster with token auth: refuse early, with the fix, when no token is there."""
    if token_source() is None:
        raise RuntimeError(
            f"joining the Ray cluster at {address} with token authentication (the default) but no "
            f"token was found: set RAY_AUTH_TOKEN_PATH=FILE (or RAY_AUTH_TOKEN, or copy the head's "
            f"~/.ray/auth_token; `ray get-auth-token` prints it there) and start every node with "
            f"{AUTH_ENV}=token; {AUTH_ENV}=disabled opts out (anyone who reaches Ray runs code)")


@contextlib.contextmanager
def auth_env(mode: str):
    """Set RAY_AUTH_MODE for this process (and the Ray processes it starts) while inside; Ray's
    C++ config caches the mode, so it is re-read on the way in and on the way out."""
    saved = os.environ.get(AUTH_ENV)
    os.environ[AUTH_ENV] = mode
    _reload_ray_config()
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(AUTH_ENV, None)
        else:
            os.environ[AUTH_ENV] = saved
        _reload_ray_config()


def _reload_ray_config() -> None:
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()  # the token's source may have changed too


@contextlib.contextmanager
def loopback_node():
    """Start a local Ray whose node address is 127.0.0.1, so its servers listen on loopback only.

    NOTE: `ray.init(_node_ip_address="127.0.0.1")` does not do it: Ray rewrites a loopback address
    to the host's routable one. Ray's own switch for a loopback-only node (the default on macOS and
    Windows, `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`) is read once at import, so it is set on the
    imported constants for the duration of the start; every Ray process started then receives
    the node address explicitly."""
    from ray._private import ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


def check_loopback() -> str:
    """The started node's address; a loud warning when it is not loopback (never silent)."""
    import ray

    address = ray.util.get_node_ip_address()
    if address != LOOPBACK:
        log.warning("the embedded Ray listens on %s, not on loopback only: other machines that reach "
                    "it can run code unless token auth stops them", address)
    return address

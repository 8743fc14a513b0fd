"""What keeps the Ray under pdserve closed to other machines and other local users. Anyone who can
reach a Ray node's GCS or raylet can run code on it, so: the embedded local Ray binds every one of
its servers (GCS, raylet, object manager, core workers, agents) to loopback, and runs with Ray's
token authentication (`RAY_AUTH_MODE=token`, Ray >= 2.52), which makes another local user without
the token unable to call it either; a joined multi-node cluster (`--address`) is expected to run
with token auth too, and `pdserve up` refuses to join without a token unless `RAY_AUTH_MODE` is set
to `disabled` explicitly. The token is Ray's own: `RAY_AUTH_TOKEN`, else the file named by
`RAY_AUTH_TOKEN_PATH`, else `~/.ray/auth_token` (`ray get-auth-token --generate` writes one). For a
local start with no token, `private_token` writes one itself, 0600 (Ray's own writer leaves it
0644), and tightens a token file of this user's that others can read. Joining a cluster, the
cluster's auth mode is probed first (`check_cluster_auth`): a cluster without token auth cannot
call back into a driver that demands tokens, and the other way round, so a mismatch is refused
with what to set on which side instead of the workers' "actor died" later. The embedded Ray keeps
its temp folder (sessions, logs, sockets), which Ray makes 0777, inside a 0700 folder of this
user's (`private_temp_dir`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
import subprocess
import sys
import tempfile

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


def token_path() -> str:
    """The token file Ray reads when $RAY_AUTH_TOKEN is unset."""
    default = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    return os.environ.get("RAY_AUTH_TOKEN_PATH") or default


def private_token() -> str | None:
    """Make the token file Ray will read private to this user: write a new token there (0600, in a
    0700 folder when it creates the folder) when there is none, or take group/other's bits off a
    file of this user's. Returns the file's path, or None when the token comes from $RAY_AUTH_TOKEN."""
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return None
    path = token_path()
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    ours = st is not None and stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()
    if st is None or (ours and not _non_empty(path)):
        os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags if ours else flags | os.O_EXCL, 0o600)
        try:
            os.fchmod(fd, 0o600)  # NOTE: O_CREAT's mode is for a new file; an empty old one keeps its own
            os.write(fd, secrets.token_hex(32).encode())  # what Ray's own generator makes: 256 bits
        finally:
            os.close(fd)
        log.warning("wrote a new Ray auth token to %s (0600)", path)
    elif ours and stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o600)
        log.warning("Ray auth token %s was mode %04o (readable by others): now 0600", path,
                    stat.S_IMODE(st.st_mode))
    return path


def private_temp_dir(base: str | None = None) -> str:
    """Ray's temp folder for the embedded local Ray: `ray` inside {base}/pdserve-ray-{uid} (base
    None: the system's temp folder, $TMPDIR or /tmp), a folder
    this user alone can enter (created 0700; refused when it is someone else's or open to others).
    Ray makes its own folders 0777 without the sticky bit (sessions, logs, sockets): the private
    parent keeps other local users out of them. NOTE: Unix socket paths inside it must stay under
    107 bytes, so the folder stays short (not under ~/.cache)."""
    from runtime.model_store import open_private_dir

    root = os.path.join(base or tempfile.gettempdir(), f"pdserve-ray-{os.geteuid()}")
    os.close(open_private_dir(root, what="Ray temp folder", hint="set TMPDIR to a private directory"))
    return os.path.join(root, "ray")


# Run in a child with RAY_AUTH_MODE=disabled and no token anywhere: does the cluster's GCS answer a
# call that carries no token? Prints 'open', or the error's type (AuthenticationError: it demands one).
_PROBE = """import sys
from ray._private.services import canonicalize_bootstrap_address
from ray._raylet import GcsClient
address = canonicalize_bootstrap_address(sys.argv[1])
if address is None:
    print("unresolved")
    sys.exit()
try:
    GcsClient(address=address).internal_kv_keys(b"", b"session", timeout=5)
except Exception as e:
    print(type(e).__name__)
else:
    print("open")
"""


def cluster_wants_token(address: str, timeout_s: float = 30.0) -> bool | None:
    """Whether the Ray cluster at `address` demands token authentication: False when its GCS
    answers a call that carries no token, True when it refuses one for want of a token, None
    when the probe could not tell (unreachable, not a Ray GCS, slow)."""
    with tempfile.TemporaryDirectory(prefix="pdserve-probe-") as home:  # an empty HOME: no ~/.ray/auth_token
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_TOKEN")}
        env.update({AUTH_ENV: "disabled", "HOME": home})
        try:
            out = subprocess.run([sys.executable, "-c", _PROBE, address], env=env, capture_output=True,
                                 text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None
    answer = (out.stdout.strip().splitlines() or [""])[-1]
    return {"open": False, "AuthenticationError": True}.get(answer)


def check_cluster_auth(address: str, mode: str) -> None:
    """Refuse to join a cluster whose auth mode differs from `mode`, saying what to set where."""
    wants = cluster_wants_token(address)
    if mode == "token" and wants is False:
        raise RuntimeError(
            f"the Ray cluster at {address} runs without token authentication (it answers calls that "
            f"carry no token), while pdserve joins with {AUTH_ENV}=token (the default), so the cluster's "
            f"processes could not call back into pdserve (its workers would die with 'The actor died "
            f"unexpectedly'); either restart every node of the cluster with {AUTH_ENV}=token and one "
            f"token (`ray get-auth-token --generate` writes ~/.ray/auth_token: copy it to every node and "
            f"to this machine), or run pdserve up with {AUTH_ENV}=disabled to join it as it is "
            f"(without token auth anyone who reaches Ray runs code)")
    if mode == "disabled" and wants is True:
        raise RuntimeError(
            f"the Ray cluster at {address} demands token authentication, while pdserve joins with "
            f"{AUTH_ENV}=disabled: unset {AUTH_ENV} (or set it to token) for pdserve up and give it the "
            f"cluster's token (RAY_AUTH_TOKEN_PATH=FILE, RAY_AUTH_TOKEN, or ~/.ray/auth_token)")


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

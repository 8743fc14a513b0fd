"""Loading NIXL (an optional dependency): `available()`, the install hint `NixlUnavailable` carries,
and the one way this project makes an agent (`_new_agent`: UCX backend, a progress thread that
sleeps between rounds instead of spinning a core, UCX's listener on the interface the cluster
uses). `nixl_pool` is the agent's use.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
import threading

INSTALL_HINT = "pip install 'pdserve[nixl]'  (on CPU: pip install --no-deps nixl nixl-cu12)"


class NixlUnavailable(RuntimeError):
    """The optional `nixl` package cannot be imported."""


def _nixl_api():
    """nixl's Python API module, or NixlUnavailable with the install hint."""
    try:
        from nixl import _api
    except ImportError as e:  # not installed, or no backend wheel (nixl-cu12, ...) for it
        raise NixlUnavailable(f"nixl is not importable ({e}); {INSTALL_HINT}") from e
    return _api


def available() -> bool:
    """Whether nixl can be imported here."""
    try:
        _nixl_api()
    except NixlUnavailable:
        return False
    return True


PROGRESS_DELAY_US = 500  # the progress thread's sleep between rounds (NIXL's Python wrapper uses 0)


_CREATING = threading.Lock()  # an agent's construction swaps a class and an environment variable
SIOCGIFADDR = 0x8915  # Linux: an interface's (primary) IPv4 address


def ucx_net_devices(host: str) -> str:
    """The network interface that carries this node's route to `host` (the peer's or this side's
    own address in the cluster): "lo" for a loopback address. "" when it cannot be told (no host,
    IPv6, an interface's secondary address): UCX then listens on every interface, its default."""
    if not host:
        return ""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # no packet is sent: only the route is looked up
            local = s.getsockname()[0]
    except OSError:
        return ""
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == local:
            return name
    return ""


def _ipv4_of(interface: str) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", interface.encode()[:15]))
        except OSError:  # no IPv4 address
            return ""
    return socket.inet_ntoa(packed[20:24])


@contextlib.contextmanager
def _ucx_devices(devices: str):
    """UCX_NET_DEVICES=devices while an agent's UCX context reads its configuration (an operator's
    own setting wins)."""
    if not devices or "UCX_NET_DEVICES" in os.environ:
        yield
        return
    os.environ["UCX_NET_DEVICES"] = devices
    try:
        yield
    finally:
        del os.environ["UCX_NET_DEVICES"]


def _new_agent(api, name: str, host: str = ""):
    """A UCX agent whose progress thread sleeps PROGRESS_DELAY_US between rounds, listening only on
    the interface that carries the cluster's route to `host` (loopback on one node: issue 49; UCX
    would otherwise listen on every interface, the pool registered for remote reads). NIXL's Python
    wrapper hard-codes a delay of 0, and its thread then spins a whole core per agent, idle or not
    (measured here: 1.00 CPU second per second; 0.02 with this delay). Without the thread, a READ
    never completes (the connection's wire-up needs the target's progress). The wrapper's config
    class is swapped, for the construction only, for one that raises the delay to this floor."""
    with _CREATING, _ucx_devices(ucx_net_devices(host)):
        return _agent_with_delay(api, name)


def _agent_with_delay(api, name: str):
    base = api.nixlBind.nixlAgentConfig

    class _Config(base):
        @property
        def pthrDelay(self):  # noqa: N802 - the binding's name
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value):  # noqa: N802
            base.pthrDelay.__set__(self, max(int(value), PROGRESS_DELAY_US))

    api.nixlBind.nixlAgentConfig = _Config
    try:
        return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
    finally:
        api.nixlBind.nixlAgentConfig = base

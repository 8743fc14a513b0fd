"""Loading NIXL (an optional dependency): `available()`, the install hint `NixlUnavailable` carries,
and the one way this project makes an agent (`_new_agent`: UCX backend, a progress thread that
sleeps between rounds instead of spinning a core). `nixl_pool` is the agent's use.
"""

from __future__ import annotations

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


def _new_agent(api, name: str):
    """A UCX agent whose progress thread sleeps PROGRESS_DELAY_US between rounds. NIXL's Python
    wrapper hard-codes a delay of 0, and its thread then spins a whole core per agent, idle or not
    (measured here: 1.00 CPU second per second; 0.02 with this delay). Without the thread, a READ
    never completes (the connection's wire-up needs the target's progress). The wrapper's config
    class is swapped, for the construction only, for one that raises the delay to this floor."""
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

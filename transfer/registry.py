"""The KV transports by name: one entry per transport, all the rest of the code needs from it.

Workers, coordinator, CLI and bench look a transport up here (`get(name)`) instead of branching
on its name: its sender and receiver factories (endpoints meeting `transfer.channel`), its own
options (a frozen dataclass declared beside its entry: `ZmqOptions`, `RayOptions`, `NixlOptions`;
the factories take one), the engine pool options its sending side needs, what it can do
(`Capabilities`) and what its delivery promises (`Guarantees`). A new transport is its entry file
in `transfer/channels/` (both of its sides) plus one `register(...)` line below, whose factories
name functions in that file.
The pool readers of `transfer.pull` (a receiver's way to read an offered pool, by the offer's
way) are declared here too (`register_source`), as "module:callable" names imported when opened.

A transport outside this package is named by its module path instead, "module:attr" (as vLLM's
`kv_connector_module_path`; `--transport mypkg.mod:Channel`): `attr` is a `Transport`, an object
(a channel class) whose `TRANSPORT` is one, or a callable with no arguments returning one,
imported in every process that looks the path up (docs/transports.md). A path that does not
name one is a `TransportPathError` naming it.

Torch-free at import (the coordinator validates names with it): the factories import their
transport when called.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from importlib import import_module
from typing import TYPE_CHECKING

from transfer.channel import ReceiverEndpoint

if TYPE_CHECKING:
    from transfer.session import SenderSession


@dataclass(frozen=True)
class NoOptions:
    """The options of a transport that takes none (a `Transport`'s default)."""


@dataclass(frozen=True)
class ZmqOptions:
    """ZeroMQ's: the port range a decode worker's receiver listens on (for firewalls)."""

    kv_port_min: int = 0  # the receiver binds the first free port of [kv_port_min, kv_port_max]
    kv_port_max: int = 0  # (0: any free port)


@dataclass(frozen=True)
class RayOptions:
    """Ray's: where a sender finds the decode worker's actor (by its name, in this namespace)."""

    namespace: str = ""


@dataclass(frozen=True)
class NixlOptions(ZmqOptions):
    """NIXL's: its control plane is ZeroMQ's (the receiver's ports); the READs need no option."""


@dataclass(frozen=True)
class Capabilities:
    """What a transport can do, read in place of its name."""

    # with its default pool options, a same-node receiver reads whole payloads straight from the
    # sender's pool (a /dev/shm file it maps: transfer.pull); any channel can, if the pool is there
    same_node_pool: bool = False
    # `SenderSession.migrate_streamed`: blocks leave while the prompt is still being computed
    streamed: bool = True
    # whole payloads are read one-sided by the receiver from the sender's registered pool on any node
    # (no sender thread moves payload bytes), host or device memory alike
    one_sided: bool = False


@dataclass(frozen=True)
class Guarantees:
    """What a channel promises about delivery, and what it does not: the protocol must be correct
    under exactly these, and the simulator (dst/) models what a channel declares. Every entry
    declares them (a required field of `Transport`)."""

    # messages (or calls) from one sender connection arrive in the order they were sent
    ordered_per_caller: bool
    # a message (or call) can run on the receiver while its reply never reaches the sender (a broken
    # link, the sender's timeout): the sender cannot tell "not done" from "done, answer lost"
    reply_may_be_lost_after_running: bool
    # the receiving end restarts under the same name with its memory lost (a Ray actor's restart)
    restarts: bool
    # with its default pool options, a payload can be read one-sided from the sender's pool: the read
    # is an event on the receiver (it lands, or fails), not a message the sender sent
    one_sided_reads_are_events: bool
    # an issued one-sided read can be cancelled (False: once issued it may still land after its
    # transfer failed, so the receiver must stop it landing, e.g. close its agent, before freeing blocks)
    issued_read_cancellable: bool


@dataclass(frozen=True)
class Transport:
    """One registered transport. Its factories are "module:function" names, imported when called
    (so this module stays torch-free and an optional transport's package is needed only in use)."""

    name: str
    # (fingerprint, TransportConfig, options, *, receiver, faults, pool) -> a transfer.session.SenderSession
    # for the decode worker named `receiver`; pool: the sending worker's KVStorage
    sender: str
    # (manager, TransportConfig, options, *, admission) -> a transfer.channel.ReceiverEndpoint
    receiver: str
    # how its senders checksum payloads: "inline" (per chunk while streaming) or "manifest" (before sending)
    checksum_mode: str = "inline"
    # EngineConfig fields a sending worker's pool needs (Ray: a /dev/shm pool that same-node peers map)
    engine_options: dict = field(default_factory=dict)
    capabilities: Capabilities = Capabilities()
    guarantees: Guarantees = field(kw_only=True)  # required: what its delivery promises
    # its options' frozen dataclass: what both its factories take (each side reads what it needs)
    options: type = field(default=NoOptions, kw_only=True)

    def options_of(self, values=None):
        """Its options from `values`: one already made, a mapping of its fields (what a worker's
        config carries) or None (the defaults); ValueError for a field it does not declare."""
        if isinstance(values, self.options):
            return values
        try:
            return self.options(**dict(values or {}))
        except TypeError as e:
            raise ValueError(f"transport {self.name!r} takes options {self.option_names()}: {e}") from None

    def option_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self.options))

    def pick_options(self, offered: dict) -> dict:
        """The values among `offered` that its options declare (the coordinator offers every setting
        a transport may take; each takes its own), as a worker's config carries them."""
        return {k: offered[k] for k in self.option_names() if k in offered}

    def make_sender(self, fingerprint, config, options=None, **kwargs) -> SenderSession:
        """kwargs: receiver (the decode worker's name), faults, pool."""
        return _load(self.sender)(fingerprint, config, self.options_of(options), **kwargs)

    def make_receiver(self, manager, config, options=None, **kwargs) -> ReceiverEndpoint:
        """kwargs: admission."""
        return _load(self.receiver)(manager, config, self.options_of(options), **kwargs)


def _load(where: str):
    module, _, name = where.partition(":")
    return getattr(import_module(module), name)


_TRANSPORTS: dict[str, Transport] = {}


def register(transport: Transport) -> Transport:
    if transport.name in _TRANSPORTS:
        raise ValueError(f"transport {transport.name!r} is registered already")
    _TRANSPORTS[transport.name] = transport
    return transport


def names() -> tuple[str, ...]:
    """Registered transport names, in registration order (the CLI's choices)."""
    return tuple(_TRANSPORTS)


class TransportPathError(ValueError):
    """A "module:attr" transport path that does not name a `Transport` (the path and why)."""


def get(name: str) -> Transport:
    """The transport called `name`, or named by the module path "module:attr"; ValueError naming
    the registered ones otherwise (TransportPathError for a path)."""
    if isinstance(name, str) and ":" in name:
        return _by_path(name)
    try:
        return _TRANSPORTS[name]
    except (KeyError, TypeError):
        raise ValueError(f"transport must be one of {', '.join(map(repr, names()))} or a 'module:attr' "
                         f"path, got {name!r}") from None


_BY_PATH: dict[str, Transport] = {}  # path -> its Transport, named by the path (what configs carry)


def _by_path(path: str) -> Transport:
    transport = _BY_PATH.get(path)
    if transport is not None:
        return transport
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise TransportPathError(f"transport path {path!r} is not 'module:attr'")
    try:
        found = getattr(import_module(module), attr)
    except Exception as e:  # noqa: BLE001 - whatever the module raises, said with the path
        raise TransportPathError(f"transport path {path!r} cannot be loaded: {type(e).__name__}: {e}") \
            from None
    if isinstance(getattr(found, "TRANSPORT", None), Transport):  # a channel class declaring its entry
        found = found.TRANSPORT
    elif not isinstance(found, Transport) and callable(found):
        try:
            found = found()
        except Exception as e:  # noqa: BLE001 - as above
            raise TransportPathError(f"transport path {path!r}: its factory raised {type(e).__name__}: {e}") \
                from None
    if not isinstance(found, Transport):
        raise TransportPathError(f"transport path {path!r} names a {type(found).__name__}, not a "
                                 "transfer.registry.Transport (nor an object with one as TRANSPORT, nor a "
                                 "factory of one)")
    transport = _BY_PATH[path] = dataclasses.replace(found, name=path)
    return transport


_SOURCES: dict[str, str] = {}


def register_source(way: str, opener: str) -> str:
    """Declare the pool reader for offers of `way` (`transfer.pull.open_source`): `opener`, a
    "module:callable" name, is imported at the first offer of that way and called as
    opener(blob: bytes, storage, host) -> a source (see transfer.pull). Declaring the same again is
    a no-op; another opener for a declared way is a ValueError."""
    if not isinstance(opener, str) or ":" not in opener:
        raise ValueError(f"a pool reader is a 'module:callable' name, got {opener!r}")
    if _SOURCES.setdefault(way, opener) != opener:
        raise ValueError(f"pool reader {way!r} is declared already ({_SOURCES[way]})")
    return way


def source_ways() -> tuple[str, ...]:
    """The declared pool reader ways, in declaration order."""
    return tuple(_SOURCES)


def source_opener(way: str):
    """The opener declared for `way`, imported now; None when the way is not declared here or its
    module cannot be imported in this process (an optional dependency missing: the offer is declined)."""
    where = _SOURCES.get(way)
    if where is None:
        return None
    try:
        return _load(where)
    except ImportError:
        return None


def validate(name: str) -> str:
    """`name` when it is registered (for config `__post_init__`s); ValueError otherwise."""
    get(name)
    return name


# ZeroMQ: each link (control DEALER, bulk link) delivers in order; a reply is lost with a broken link
# or a sender's timeout; a restarted worker listens at a new address
register(Transport("zmq", "transfer.channels.zmq:make_sender", "transfer.channels.zmq:make_receiver",
                   options=ZmqOptions,
                   guarantees=Guarantees(ordered_per_caller=True, reply_may_be_lost_after_running=True,
                                         restarts=False, one_sided_reads_are_events=False,
                                         issued_read_cancellable=True)))
# Ray: calls from one caller arrive in order, a call can run while its reply is lost, actors restart;
# a same-node receiver reads the sender's /dev/shm pool (a read, not a message; not cancellable)
register(Transport("ray", "transfer.channels.ray:make_sender", "transfer.channels.ray:make_receiver",
                   checksum_mode="manifest", engine_options={"kv_shm": True},
                   capabilities=Capabilities(same_node_pool=True), options=RayOptions,
                   guarantees=Guarantees(ordered_per_caller=True, reply_may_be_lost_after_running=True,
                                         restarts=True, one_sided_reads_are_events=True,
                                         issued_read_cancellable=False)))
# NIXL: ZeroMQ's control; a READ is an event, and an issued READ cannot be cancelled (UCX)
register(Transport("nixl", "transfer.channels.nixl:make_sender", "transfer.channels.nixl:make_receiver",
                   checksum_mode="manifest", capabilities=Capabilities(one_sided=True), options=NixlOptions,
                   guarantees=Guarantees(ordered_per_caller=True, reply_may_be_lost_after_running=True,
                                         restarts=False, one_sided_reads_are_events=True,
                                         issued_read_cancellable=False)))

register_source("shm", "transfer.pull:ShmSource")
register_source("nixl", "transfer.channels.nixl:NixlSource")

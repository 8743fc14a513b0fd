"""`--transport` of every command that brings a cluster up: a registered transport's name, or one
loaded by module path ("module:attr", docs/transports.md), checked when the arguments are parsed so
that a bad one is refused before Ray starts, naming what is wrong."""

from __future__ import annotations

import argparse

from transfer.registry import TransportPathError, get, names

METAVAR = "{" + ",".join(names()) + "} or module:attr"


def transport(text: str) -> str:
    """argparse `type`: `text` when it names a transport (TransportPathError's text otherwise)."""
    if text in names():
        return text
    if ":" not in text:
        raise argparse.ArgumentTypeError(f"unknown transport {text!r}: choose from {', '.join(names())}, or "
                                         "name one by module path, module:attr")
    try:
        get(text)
    except (TransportPathError, KeyError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add(p, default: str | None = None) -> None:
    """Add `--transport` to parser `p`."""
    p.add_argument("--transport", type=transport, metavar=METAVAR, default=default,
                   help="KV migration transport (default zmq), or one loaded by module path "
                        "(docs/transports.md)")

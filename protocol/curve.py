"""Cluster keys for the ZeroMQ sockets: CURVE encryption plus a ZAP allowlist on the report socket
and on the KV control socket, and an HMAC keyed handshake for KV connections (whose bulk bytes,
on the bulk link, stay unencrypted for speed).

`pdserve up` makes one `ClusterKeys` at start and hands it to every worker through Ray. A report
socket (`PullQueue`) is a CURVE server that admits only clients holding the cluster's key pair,
so a peer without it can neither connect nor forge a worker's report. A KV receiver's control
socket is a CURVE server too, keyed with `kv_keys(secret)` (a key pair derived from the cluster
secret the KV link already carries): a peer without the secret never completes the ZeroMQ
handshake, so it never gets to send an application frame (libzmq buffers a multipart message
whole before the application sees any of it; issue 49). Inside that, KV receivers check the
`hmac_sign` tag each sender puts in its handshake (a fresh nonce and timestamp, so a recorded
handshake cannot be replayed, and the receiver's name, so it cannot be redirected) before they
answer anything else on that connection.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import time
from dataclasses import dataclass

import zmq
from zmq.utils import z85

HANDSHAKE_MAX_AGE_S = 60.0  # a handshake older (or newer) than this is refused
TAG_HEX, NONCE_HEX = 64, 32   # lengths of an hmac_sign tag and a new_nonce, in hex digits
_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class ClusterKeys:
    public: str   # z85 CURVE public key
    secret: str   # z85 CURVE secret key (also the HMAC key of the KV handshake)

    @staticmethod
    def generate() -> ClusterKeys:
        public, secret = zmq.curve_keypair()
        return ClusterKeys(public.decode(), secret.decode())

    def to_dict(self) -> dict:
        return {"public": self.public, "secret": self.secret}


def kv_keys(secret: str) -> ClusterKeys:
    """The CURVE key pair of the KV control socket for cluster secret `secret` (any non-empty str:
    tests use plain words): SHA-256 of the secret under this socket's own label is the Curve25519
    secret key, so every holder of the secret has the pair and nobody else can make it."""
    if not secret:
        raise ValueError("a KV CURVE key pair needs the cluster secret")
    seed = hashlib.sha256(b"pdserve-kv-curve\x00" + secret.encode()).digest()  # 32 bytes
    private = z85.encode(seed)
    return ClusterKeys(zmq.curve_public(private).decode(), private.decode())


class _OnlyClusterKey:
    """ZAP credentials: the one client key the cluster holds."""

    def __init__(self, public: str):
        self.public = public.encode()

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self.public)


def serve_curve(sock, keys: ClusterKeys, authenticator_class) -> object:
    """Make `sock` a CURVE server that admits only the cluster's key; call before bind. Returns the
    started ZAP authenticator (stop it when the socket closes)."""
    authenticator = authenticator_class(sock.context)
    authenticator.start()
    authenticator.configure_curve_callback(domain="*", credentials_provider=_OnlyClusterKey(keys.public))
    sock.curve_secretkey = keys.secret.encode()
    sock.curve_publickey = keys.public.encode()
    sock.curve_server = True
    return authenticator


def connect_curve(sock, keys: ClusterKeys) -> None:
    """Make `sock` a CURVE client of a server holding the cluster keys; call before connect."""
    sock.curve_serverkey = keys.public.encode()
    sock.curve_publickey = keys.public.encode()
    sock.curve_secretkey = keys.secret.encode()


def hmac_sign(secret: str, fields: list[str], issued_at: float, nonce: str) -> str:
    message = "\x1f".join([*fields, repr(issued_at), nonce]).encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def new_nonce() -> str:
    return os.urandom(16).hex()


def is_hex(value, length: int) -> bool:
    """`value` is a str of exactly `length` lowercase hex digits (what hmac_sign and new_nonce make)."""
    return type(value) is str and len(value) == length and _HEX.issuperset(value)


def tag_matches(secret: str, fields: list[str], issued_at: float, nonce: str, tag) -> bool:
    """The tag is hmac_sign's for these fields. `nonce` and `tag` come from a peer: anything but
    ASCII hex of the right length is refused before `compare_digest` (which raises TypeError on
    a non-ASCII str), and the digests are compared as bytes."""
    if not (is_hex(tag, TAG_HEX) and is_hex(nonce, NONCE_HEX) and type(issued_at) is float
            and math.isfinite(issued_at)):
        return False
    return hmac.compare_digest(hmac_sign(secret, fields, issued_at, nonce).encode(), tag.encode())


def hmac_verify(secret: str, fields: list[str], issued_at: float, nonce: str, tag: str,
                seen: dict[str, float]) -> bool:
    """True for a fresh, never-seen handshake signed with the cluster secret. `seen` remembers
    nonces (pruned past the maximum age) so a recorded handshake is refused. Never raises for
    what a peer sent: a malformed nonce or tag is just not genuine."""
    now = time.time()
    for old in [n for n, t in seen.items() if now - t > HANDSHAKE_MAX_AGE_S]:
        del seen[old]
    if not (is_hex(nonce, NONCE_HEX) and type(issued_at) is float and math.isfinite(issued_at)):
        return False
    fresh = abs(now - issued_at) <= HANDSHAKE_MAX_AGE_S and nonce not in seen
    valid = fresh and tag_matches(secret, fields, issued_at, nonce, tag)
    if valid:
        seen[nonce] = now
    return valid

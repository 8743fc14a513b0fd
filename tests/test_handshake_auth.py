"""The keyed KV handshake (protocol.curve): a handshake signed with the cluster secret is accepted
once; a replay of it, a changed field, a wrong secret or a stale timestamp is refused."""

import time

from protocol.curve import HANDSHAKE_MAX_AGE_S, ClusterKeys, hmac_sign, hmac_verify, new_nonce


def test_signed_handshake_accepted_once_and_every_tampering_refused():
    secret = ClusterKeys.generate().secret
    fields, issued_at, nonce = ['{"model": "m"}', "prefill-0"], time.time(), new_nonce()
    tag = hmac_sign(secret, fields, issued_at, nonce)
    seen: dict = {}
    assert hmac_verify(secret, fields, issued_at, nonce, tag, seen)
    assert not hmac_verify(secret, fields, issued_at, nonce, tag, seen)  # a recorded handshake, replayed
    fresh = new_nonce()
    assert not hmac_verify(secret, [fields[0], "intruder"], issued_at, fresh, tag, seen)  # changed peer
    assert not hmac_verify(ClusterKeys.generate().secret, fields, issued_at, fresh,
                           hmac_sign("other", fields, issued_at, fresh), seen)  # another secret
    old = time.time() - 2 * HANDSHAKE_MAX_AGE_S
    assert not hmac_verify(secret, fields, old, fresh, hmac_sign(secret, fields, old, fresh), seen)
    assert hmac_verify(secret, fields, issued_at, fresh, hmac_sign(secret, fields, issued_at, fresh), seen)

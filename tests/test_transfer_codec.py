"""Wire codec: typed messages round-trip through msgpack; bad bytes give typed errors (version,
garbage, unknown fields, absurd counts) before anything is sized by them; a fuzzer feeding
mutated manifests to the decoder sees nothing but E.TransferError subclasses."""

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from transfer import errors as E
from transfer.schema import Limits
from transfer.wire_codec import decode, decode_manifest, encode, unpack
from transfer.wire_messages import Ack, DecodeState, FrameDesc, Held, Hello, Manifest, Nack, Query

FP = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "dtype": "float16", "block_size": 16,
      "layout": "block-major/NL2BHD", "model": "test-model"}


SAMPLING = {"temperature": 0.7, "stop_token_ids": [2], "seed": 5}


def make_manifest(n=40, mode="manifest") -> Manifest:
    nb = -(-n // 16)
    sums = (11, 22) if mode == "manifest" else None
    return Manifest(request_id="req-1", epoch=3, fingerprint=dict(FP), num_tokens=n,
                    block_tokens=tuple([16] * (nb - 1) + [n - 16 * (nb - 1)]),
                    block_hashes=tuple(range(n // 16)), frames=(FrameDesc(0, nb, nb * 4096, sums),),
                    chunk_bytes=8192, state=DecodeState(list(range(n + 1)), SAMPLING, 1),
                    checksum_mode=mode, extra_key="lora-a")


def wire(m: Manifest) -> dict:
    return msgpack.unpackb(encode(m), raw=False)


def pack(d: dict) -> bytes:
    return msgpack.packb(d, use_bin_type=True)


@pytest.mark.parametrize("mode", ["manifest", "inline"])
def test_manifest_round_trip_fills_sampling_defaults(mode):
    m = make_manifest(mode=mode)
    back = decode_manifest(encode(m))
    assert back.frames == m.frames and back.state.token_ids == m.state.token_ids
    assert back.state.sampling["temperature"] == 0.7 and back.state.sampling["top_p"] == 1.0
    assert back.state.sampling["seed"] == 5 and back.state.sampling["stop_token_ids"] == [2]
    assert (back.request_id, back.epoch, back.extra_key, back.num_tokens) == ("req-1", 3, "lora-a", 40)


@pytest.mark.parametrize("msg", [Hello(FP, "p"), Query("r", 16, (1, 2, 3)), Held("r", (0, 2)),
                                 Ack("r", 1, 3, 1, 99, {"commit_ms": 0.5}), Nack("r", 1, "checksum", "bad")])
def test_control_messages_round_trip(msg):
    assert decode(encode(msg)) == msg


def test_unknown_protocol_version_is_typed():
    d = wire(make_manifest())
    d["v"] = 99
    with pytest.raises(E.ProtocolVersionError):
        decode_manifest(pack(d))


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x92\x01", b"hello world", bytes(range(256)),
                                  pack([1, 2, 3]), pack({"kind": "manifest"})])
def test_garbage_bytes_are_malformed(data):
    with pytest.raises(E.MalformedMessage):
        decode_manifest(data)


def test_wrong_kind_and_unknown_field_refused():
    with pytest.raises(E.MalformedMessage, match="unexpected message kind"):
        decode(encode(Hello(FP)), expect=Manifest)
    d = wire(make_manifest())
    d["surprise"] = 1
    with pytest.raises(E.MalformedMessage, match="unknown field"):
        decode_manifest(pack(d))
    d = wire(make_manifest())
    d["state"]["sampling"]["temperature_typo"] = 1.0
    with pytest.raises(E.MalformedMessage, match="unknown field"):
        decode_manifest(pack(d))


@pytest.mark.parametrize("mutate, err", [
    (lambda d: d.update(num_tokens=10**12), E.LimitExceeded),
    (lambda d: d["frames"][0].__setitem__(2, 2**62), E.LimitExceeded),
    (lambda d: d["frames"].extend([[0, 1, 4096, None]] * 100), E.LimitExceeded),
    (lambda d: d.update(chunk_bytes=1), E.LimitExceeded),
    (lambda d: d["fingerprint"].update(block_size=10**9), E.LimitExceeded),
    (lambda d: d["state"].update(token_ids=b"\x00" * 4 * (Limits().max_tokens + 1)), E.LimitExceeded),
    # sampling is checked by the one SamplingParams (protocol.sampling): a MalformedMessage naming the field
    (lambda d: d["state"]["sampling"].update(n=10**6), E.MalformedMessage),
    (lambda d: d["state"]["sampling"].update(n=17), E.MalformedMessage),  # above MAX_N, as over HTTP
    (lambda d: d["state"]["sampling"].update(top_p=0.0), E.MalformedMessage),  # (0, 1] everywhere
    (lambda d: d["state"]["sampling"].update(temperature=float("nan")), E.MalformedMessage),
    (lambda d: d.update(epoch=-1), E.LimitExceeded),
    (lambda d: d.update(request_id="x" * 5000), E.LimitExceeded),
    (lambda d: d.update(block_hashes=b"\x00" * 7), E.MalformedMessage),
    (lambda d: d.update(block_tokens=b"\x10\x00\x00\x00" * 3), E.MalformedMessage),
    (lambda d: d["frames"][0].__setitem__(3, b"\x00" * 8), E.MalformedMessage),  # one checksum for 2 chunks
    (lambda d: d.update(epoch=True), E.MalformedMessage),
    (lambda d: d.update(checksum="crc32"), E.MalformedMessage),
    (lambda d: d["state"].update(token_ids=b"\x01\x00\x00\x00"), E.MalformedMessage),  # fewer ids than tokens
])
def test_schema_bounds(mutate, err):
    d = wire(make_manifest())
    mutate(d)
    with pytest.raises(err):
        decode_manifest(pack(d))


def test_oversized_message_refused_before_parsing():
    with pytest.raises(E.LimitExceeded):
        unpack(b"\x00" * 2000, Limits(max_message_bytes=1000))


def test_remote_error_codes_map_back_to_classes():
    err = E.error_from_code("stale_epoch", "old")
    assert type(err).__name__ == "StaleEpoch" and err.remote
    assert type(E.error_from_code("no-such-code", "x")) is E.TransferError


BASE = encode(make_manifest())


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(BASE) - 1), st.integers(0, 255)), min_size=1, max_size=8),
       st.integers(0, len(BASE)))
def test_fuzz_mutated_manifest_bytes_only_typed_errors(edits, cut):
    data = bytearray(BASE)
    for pos, val in edits:
        data[pos] = val
    try:
        m = decode_manifest(bytes(data[:cut] if cut < len(BASE) // 2 else data))
    except E.TransferError:
        return
    assert isinstance(m, Manifest)

"""Golden vectors (bindings/vectors/frames.json) and malformed-input handling."""

import json
import os

import pytest

from polygate import _wire

VECTORS_PATH = os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "vectors", "frames.json")
)


def _load():
    if not os.path.exists(VECTORS_PATH):
        return None
    with open(VECTORS_PATH, encoding="utf-8") as f:
        return json.load(f)


DOC = _load()
VECTORS = DOC["vectors"] if DOC else []


def test_vectors_file_present():
    # Must fail, not skip: a binding that is not checked against the vectors is unverified.
    assert DOC is not None, "golden vectors missing: %s" % VECTORS_PATH
    assert DOC["protocol_version"] == _wire.SCHEMA_VERSION
    assert DOC["encoding"] == "bincode-legacy"
    assert VECTORS, "no vectors in %s" % VECTORS_PATH


def _codec(direction):
    if direction == "client":
        return _wire.encode_client_frame, _wire.decode_client_frame
    assert direction == "server", direction
    return _wire.encode_server_frame, _wire.decode_server_frame


@pytest.mark.parametrize("vec", VECTORS, ids=[v["name"] for v in VECTORS])
def test_vector_encodes_byte_for_byte(vec):
    enc, _ = _codec(vec["direction"])
    assert _wire.frame(enc(vec["value"])).hex() == vec["frame_hex"].lower()


@pytest.mark.parametrize("vec", VECTORS, ids=[v["name"] for v in VECTORS])
def test_vector_decodes_back(vec):
    _, dec = _codec(vec["direction"])
    data = bytes.fromhex(vec["frame_hex"])
    payload, rest = _wire.split_frame(data)
    assert rest == b""
    assert dec(payload) == vec["value"]
    # and through the incremental decoder, one byte at a time
    d = _wire.FrameDecoder(1 << 20)
    frames = []
    for i in range(len(data)):
        frames += d.feed(data[i:i + 1])
    assert frames == [payload] and d.pending == 0


def test_vectors_cover_every_variant():
    seen = {"client": set(), "server": set()}
    for v in VECTORS:
        body = v["value"]["request" if v["direction"] == "client" else "reply"]
        seen[v["direction"]].add(body if isinstance(body, str) else next(iter(body)))
    assert seen["client"] == set(_wire.REQUEST.index), "requests without a vector"
    assert seen["server"] == set(_wire.REPLY.index), "replies without a vector"


# ---------------------------------------------------------------- malformed input

def _ok_payload():
    return _wire.encode_client_frame({"id": 1, "request": {"BeginCall": {"scope": "chat", "est_tokens": 5}}})


@pytest.mark.parametrize("value, needle", [
    ({"id": -1, "request": "Ping"}, "id: expected u64"),
    ({"id": 1 << 64, "request": "Ping"}, "id: expected u64"),
    ({"id": True, "request": "Ping"}, "id: expected u64"),
    ({"id": 1, "request": "Pong"}, "unknown Request variant 'Pong'"),
    ({"id": 1, "request": {"BeginCall": {"scope": 3}}}, "request.BeginCall.scope: expected string"),
    ({"id": 1, "request": {"BeginCall": {"scope": "x", "est_tokens": 1.5}}}, "est_tokens"),
    ({"id": 1, "request": {"BeginCall": {"scope": "x", "bogus": 1}}}, "unknown field(s) bogus"),
    ({"id": 1, "request": {"Acquire": {}}}, "request.Acquire.call: missing field"),
    ({"id": 1, "request": "Acquire"}, "with fields"),
    ({"id": 1, "request": {"Report": {"permit": 1, "outcome": {"Failure": {"kind": "Oops"}}}}},
     "unknown FailureKind variant 'Oops'"),
    ({"id": 1, "request": {"ForceOpen": {"source": "s", "seconds": "3"}}}, "expected f64"),
    ({"id": 1, "request": {"Ping": 1}}, "unit variant"),
    ({"id": 1}, "request: missing field"),
    ([1, 2], "ClientFrame as a dict"),
])
def test_encode_rejects_bad_values(value, needle):
    with pytest.raises(_wire.WireError) as ei:
        _wire.encode_client_frame(value)
    assert needle in str(ei.value)
    assert isinstance(ei.value, ValueError)


def test_missing_option_field_encodes_as_none():
    a = _wire.encode_client_frame({"id": 1, "request": {"BeginCall": {"scope": "c"}}})
    b = _wire.encode_client_frame({"id": 1, "request": {"BeginCall": {"scope": "c", "est_tokens": None}}})
    assert a == b


def test_decode_truncated():
    p = _ok_payload()
    for n in range(len(p)):
        with pytest.raises(_wire.WireError, match="truncated"):
            _wire.decode_client_frame(p[:n])


def test_decode_trailing_bytes():
    with pytest.raises(_wire.WireError, match="1 trailing byte"):
        _wire.decode_client_frame(_ok_payload() + b"\0")


def test_decode_unknown_tag():
    p = bytearray(_ok_payload())
    p[8:12] = (99).to_bytes(4, "little")
    with pytest.raises(_wire.WireError, match="unknown Request tag 99"):
        _wire.decode_client_frame(bytes(p))


def test_decode_bad_option_and_bool_and_utf8():
    p = bytearray(_ok_payload())
    p[-9] = 7  # est_tokens Option tag
    with pytest.raises(_wire.WireError, match="invalid Option tag 7"):
        _wire.decode_client_frame(bytes(p))
    granted = bytearray(_wire.encode_server_frame({"id": 1, "reply": {"Granted": {
        "permit": 1, "source": "s", "is_probe": True, "attempt": 1, "est_tokens": 1}}}))
    granted[8 + 4 + 8 + 8 + 1] = 2  # is_probe
    with pytest.raises(_wire.WireError, match="invalid bool byte 2"):
        _wire.decode_server_frame(bytes(granted))
    bad = bytearray(_ok_payload())
    bad[8 + 4 + 8] = 0xFF  # first byte of "chat"
    with pytest.raises(_wire.WireError, match="not valid UTF-8"):
        _wire.decode_client_frame(bytes(bad))


def test_decode_absurd_sequence_length():
    status = bytearray(_wire.encode_server_frame({"id": 1, "reply": {"Status": {
        "sidecar_version": "v", "backend": "memory", "scopes": []}}}))
    status[-8:] = (1 << 60).to_bytes(8, "little")
    with pytest.raises(_wire.WireError, match="exceeds"):
        _wire.decode_server_frame(bytes(status))


def test_frame_decoder_limits_and_chunks():
    d = _wire.FrameDecoder(max_frame=10)
    assert d.feed(_wire.frame(b"abc")[:2]) == []
    assert d.feed(_wire.frame(b"abc")[2:] + _wire.frame(b"") + _wire.frame(b"x")[:4]) == [b"abc", b""]
    assert d.feed(b"x") == [b"x"]
    with pytest.raises(_wire.WireError, match="exceeds max_frame 10"):
        d.feed((11).to_bytes(4, "big"))
    with pytest.raises(_wire.WireError, match="exceeds max_frame 2"):
        _wire.frame(b"abc", max_frame=2)

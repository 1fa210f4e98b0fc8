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


# ---------------------------------------------------------------- the hot codec (polygate._frames)
#
# Every vector of a hot frame must also pass through the struct encoders and
# decoders the clients use, byte for byte; they must agree with the generic codec
# on every input, malformed ones included.

from polygate import _frames  # noqa: E402


def _hot_outcome(o):
    name = o if isinstance(o, str) else next(iter(o))
    body = None if isinstance(o, str) else o[name]
    if name == "Success":
        return _frames.success(body["tokens"], body["count_attempt"])
    if name == "Failure":
        return _frames.failure(body["kind"])
    if name == "RateLimited":
        return _frames.rate_limited(body["retry_after_s"])
    if name == "Cancelled":
        return _frames.CANCELLED
    if name == "SuccessUsage":
        u = body["usage"]
        return _frames.success_usage(u["tokens"], u["input_tokens"], u["output_tokens"], body["count_attempt"])
    if name == "FailureUsage":
        u = body["usage"]
        return _frames.failure_usage(body["kind"], u["tokens"], u["input_tokens"], u["output_tokens"])
    if name == "SuccessCached":
        u = body["usage"]
        return _frames.success_cached(u["tokens"], u["input_tokens"], u["output_tokens"],
                                      body["cached_input_tokens"], body["count_attempt"])
    raise AssertionError("outcome %r has no hot encoder" % name)


def _spec(b):
    return _frames.call_spec(b["scope"], b["est_tokens"], b["priority"], b["est_input_tokens"],
                             b["est_output_tokens"])


HOT_ENCODERS = {
    "Start": lambda b: _frames.start(_spec(b)),
    "Begin": lambda b: _frames.begin(_spec(b)),
    "StartTenant": lambda b: _frames.start_tenant(_spec(b["spec"]), _frames.tenant(b["tenant"])),
    "BeginTenant": lambda b: _frames.begin_tenant(_spec(b["spec"]), _frames.tenant(b["tenant"])),
    "Retry": lambda b: _frames.retry(b["permit"], _hot_outcome(b["outcome"])),
    "Finish": lambda b: _frames.finish(b["permit"], _hot_outcome(b["outcome"])),
    "Report": lambda b: _frames.report(b["permit"], _hot_outcome(b["outcome"])),
    "Acquire": lambda b: _frames.acquire(b["call"]),
    "EndCall": lambda b: _frames.end_call(b["call"]),
    "Cancel": lambda b: _frames.cancel(b["target"]),
}
def _variant_name(x):
    return x if isinstance(x, str) else next(iter(x))


HOT_CLIENT = [v for v in VECTORS if v["direction"] == "client" and _variant_name(v["value"]["request"]) in HOT_ENCODERS]
HOT_SERVER = [v for v in VECTORS if v["direction"] == "server" and _variant_name(v["value"]["reply"]) in _frames.HOT_REPLIES]


def test_hot_sets_are_the_brief():
    assert set(HOT_ENCODERS) - {"Begin", "BeginTenant"} == set(_frames.HOT_REQUESTS)
    assert set(_frames.HOT_REPLIES) == {"Started", "Granted", "Reported", "Error", "CallBegun", "Ok", "Pong"}
    # every hot variant has vectors; every outcome variant is covered by some hot vector
    assert {_variant_name(v["value"]["request"]) for v in HOT_CLIENT} == set(HOT_ENCODERS)
    assert {_variant_name(v["value"]["reply"]) for v in HOT_SERVER} == set(_frames.HOT_REPLIES)
    outcomes = {_variant_name(v["value"]["request"][_variant_name(v["value"]["request"])]["outcome"])
                for v in HOT_CLIENT if _variant_name(v["value"]["request"]) in ("Report", "Retry", "Finish")}
    assert outcomes == {name for name, _ in _wire.OUTCOME.variants}


@pytest.mark.parametrize("vec", HOT_CLIENT, ids=[v["name"] for v in HOT_CLIENT])
def test_vector_hot_encoder_byte_for_byte(vec):
    req = vec["value"]["request"]
    name = _variant_name(req)
    data = _frames.frame(vec["value"]["id"], HOT_ENCODERS[name](req[name]))
    assert data.hex() == vec["frame_hex"].lower()


@pytest.mark.parametrize("vec", HOT_SERVER, ids=[v["name"] for v in HOT_SERVER])
def test_vector_hot_decoder(vec):
    payload, _ = _wire.split_frame(bytes.fromhex(vec["frame_hex"]))
    hot = _frames.decode_hot_reply(payload)
    assert hot is not None, "the struct path must take %s" % vec["name"]
    assert {"id": hot[0], "reply": hot[1]} == vec["value"]
    assert _frames.decode_server_frame(payload) == vec["value"]


def _same(payload):
    """The hot decoder and the generic one agree: same value, or same error."""
    try:
        want = ("ok", _wire.decode_server_frame(payload))
    except _wire.WireError as e:
        want = ("err", str(e))
    try:
        got = ("ok", _frames.decode_server_frame(payload))
    except _wire.WireError as e:
        got = ("err", str(e))
    assert repr(got) == repr(want), payload.hex()  # repr: NaN == NaN
    hot = _frames.decode_hot_reply(payload)
    if hot is not None:
        assert repr(want) == repr(("ok", {"id": hot[0], "reply": hot[1]})), payload.hex()


@pytest.mark.parametrize("vec", HOT_SERVER, ids=[v["name"] for v in HOT_SERVER])
def test_hot_decoder_agrees_on_mutations(vec):
    payload, _ = _wire.split_frame(bytes.fromhex(vec["frame_hex"]))
    for n in range(len(payload) + 1):  # every truncation
        _same(payload[:n])
    _same(payload + b"\0")
    for i in range(8, len(payload)):  # every byte after the id, set to values that matter
        for v in (0, 1, 2, 0x7F, 0xFF):
            m = bytearray(payload)
            m[i] = v
            _same(bytes(m))


def test_hot_decoder_cold_tags_fall_back():
    for vec in VECTORS:
        if vec["direction"] == "server" and vec not in HOT_SERVER:
            payload, _ = _wire.split_frame(bytes.fromhex(vec["frame_hex"]))
            assert _frames.decode_hot_reply(payload) is None
            assert _frames.decode_server_frame(payload) == vec["value"]

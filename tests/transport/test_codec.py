import dataclasses
import random

import msgpack
import numpy as np
import pytest

from arl.api.types import GenerateRequest, GenerateResponse, GenerationConfig, SampleOutput, Trajectory
from arl.transport import codec
from arl.transport.codec import CONTROL_TYPES, PROTOCOL_VERSION, MalformedMessage, decode, encode


def _sample(n: int, v: int = 3, reason: str = "stop") -> SampleOutput:
    return SampleOutput(np.arange(n) + 10, -np.arange(n, dtype=np.float32) / 7, np.full(n, v), reason)


def _traj(n: int = 6, gid: str = "g0", **meta) -> Trajectory:
    mask = np.zeros(n, np.int8)
    mask[n // 2 :] = 1
    return Trajectory(
        input_ids=np.arange(n),
        loss_mask=mask,
        logprobs=np.where(mask, -0.5, 0.0),
        versions=np.where(mask, 4, -1),
        reward=1.0,
        group_id=gid,
        turn_rewards=[0.0, 1],
        metadata=meta,
    )


def _body(msg) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def _env(msg_type, payload, v=PROTOCOL_VERSION) -> bytes:
    return _body({"type": msg_type, "v": v, "payload": payload})


def _arr(a: np.ndarray, name: str) -> dict:
    return {"dtype": name, "data": a.tobytes()}


def _req_payload(**over) -> dict:
    p = {
        "qid": "q",
        "input_ids": _arr(np.arange(4, dtype="<i4"), "int32"),
        "gconfig": dataclasses.asdict(GenerationConfig()),
        "session_id": None,
    }
    p.update(over)
    return p


# ------------------------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("n_tokens", [0, 1, 4096])
@pytest.mark.parametrize("session_id", [None, "chat-7"])
def test_gen_req_round_trip(n_tokens, session_id):
    g = GenerationConfig(n=4, max_new_tokens=9, min_new_tokens=2, temperature=0.7, top_p=0.9, top_k=5,
                         greedy=False, stop_token_ids=[2, 3])
    req = GenerateRequest("q-1", np.arange(n_tokens) * 3 - 5, g, session_id)
    t, out = decode(encode("gen_req", req))
    assert t == "gen_req" and isinstance(out, GenerateRequest)
    assert out.qid == "q-1" and out.session_id == session_id and out.gconfig == g
    assert out.input_ids.dtype == np.int32 and out.input_ids.shape == (n_tokens,)
    np.testing.assert_array_equal(out.input_ids, req.input_ids)


@pytest.mark.parametrize("lens", [[], [0], [5], [3, 0, 7, 1]])
def test_gen_resp_round_trip_n_samples(lens):
    resp = GenerateResponse("q", [_sample(n, v=i, reason=("stop", "length", "abort")[i % 3]) for i, n in enumerate(lens)])
    t, out = decode(encode("gen_resp", resp))
    assert t == "gen_resp" and isinstance(out, GenerateResponse) and out.error is None
    assert len(out.samples) == len(lens)
    for a, b in zip(resp.samples, out.samples):
        assert isinstance(b, SampleOutput) and b.finish_reason == a.finish_reason
        for f in ("output_ids", "output_logprobs", "output_versions"):
            assert getattr(b, f).dtype == getattr(a, f).dtype
            np.testing.assert_array_equal(getattr(b, f), getattr(a, f))
    assert out.output_ids == [s.output_ids for s in out.samples] or not lens


def test_gen_resp_error_round_trip():
    _, out = decode(encode("gen_resp", GenerateResponse("q", error="engine error: boom")))
    assert out.samples == [] and out.error == "engine error: boom"


def test_traj_round_trip():
    meta = {"turns": 2, "reason": "stop", "t": 0.25, "ok": True, "none": None, "nested": {"a": [1, "x", {"b": 2.5}]}}
    group = [_traj(6, **meta), _traj(0), _traj(9, gid="g0")]
    t, out = decode(encode("traj", group))
    assert t == "traj" and len(out) == 3
    for a, b in zip(group, out):
        assert isinstance(b, Trajectory)
        for f in ("input_ids", "loss_mask", "logprobs", "versions"):
            assert getattr(b, f).dtype == getattr(a, f).dtype
            np.testing.assert_array_equal(getattr(b, f), getattr(a, f))
        assert (b.reward, b.group_id, b.turn_rewards, b.metadata) == (a.reward, a.group_id, a.turn_rewards, a.metadata)
        assert b.num_generated == a.num_generated and b.turn_discount is None
    tagged = _traj(4)
    tagged.turn_discount = 0.0
    assert decode(encode("traj", [tagged]))[1][0].turn_discount == 0.0


def test_traj_metadata_tuple_becomes_list():
    _, out = decode(encode("traj", [_traj(2, span=(1, 2))]))
    assert out[0].metadata == {"span": [1, 2]}


@pytest.mark.parametrize("msg_type", sorted(CONTROL_TYPES))
def test_control_round_trip(msg_type):
    payload = {"version": 3, "path": "/tmp/w", "ok": True, "x": 1.5, "none": None, "l": [1, "a"], "d": {"k": [2]}}
    assert decode(encode(msg_type, payload)) == (msg_type, payload)
    assert decode(encode(msg_type)) == (msg_type, {})


def test_wire_keys_match_dataclass_fields():
    # decode builds dataclasses without __post_init__; a field added to the types must be added to the codec too
    names = lambda cls: frozenset(f.name for f in dataclasses.fields(cls))  # noqa: E731
    assert codec._GEN_REQ_KEYS == names(GenerateRequest)
    assert codec._GEN_RESP_KEYS == names(GenerateResponse)
    assert codec._SAMPLE_KEYS == names(SampleOutput)
    assert codec._TRAJ_KEYS == names(Trajectory)
    assert codec._GCONFIG_KEYS == names(GenerationConfig)


def test_arrays_travel_as_raw_bytes():
    req = GenerateRequest("q", np.arange(4096), GenerationConfig())
    frame = encode("gen_req", req)
    assert len(frame) < 4096 * 4 + 512
    raw = msgpack.unpackb(frame)
    arr = raw["payload"]["input_ids"]
    assert arr["dtype"] == "int32" and isinstance(arr["data"], bytes) and len(arr["data"]) == 4096 * 4
    assert raw["type"] == "gen_req" and raw["v"] == PROTOCOL_VERSION
    resp = GenerateResponse("q", [_sample(1000)])
    assert len(encode("gen_resp", resp)) < 1000 * 12 + 512


def test_non_contiguous_and_wrong_dtype_arrays_are_converted_on_encode():
    req = GenerateRequest("q", np.arange(10), GenerationConfig())
    req.input_ids = np.arange(20, dtype=np.int64)[::2]  # mutated after construction
    _, out = decode(encode("gen_req", req))
    np.testing.assert_array_equal(out.input_ids, np.arange(0, 20, 2))


# ------------------------------------------------------------------------------------------------ encode errors


def test_encode_rejects_programming_errors():
    with pytest.raises(ValueError, match="unknown message type"):
        encode("nope", {})
    with pytest.raises(TypeError):
        encode("gen_req", GenerateResponse("q"))
    with pytest.raises(TypeError):
        encode("gen_resp", {"qid": "q"})
    with pytest.raises(TypeError, match="whole group"):
        encode("traj", _traj())
    with pytest.raises(TypeError, match="non-empty"):
        encode("traj", [])
    with pytest.raises(TypeError, match="metadata.x"):
        encode("traj", [_traj(x=np.float32(1.0))])
    with pytest.raises(TypeError, match="metadata.b"):
        encode("traj", [_traj(b=b"raw")])
    with pytest.raises(TypeError, match="dict"):
        encode("heartbeat", [1, 2])
    with pytest.raises(TypeError, match=r"heartbeat.stats\[0\]: map keys must be str"):
        encode("heartbeat", {"stats": [{1: 2}]})  # the receiver would reject the whole frame
    with pytest.raises(TypeError, match="gconfig.n"):
        encode("gen_req", GenerateRequest("q", [1], GenerationConfig(n=True)))


# ------------------------------------------------------------------------------------------------ malformed frames

_GOOD_REQ = encode("gen_req", GenerateRequest("q", [1, 2, 3], GenerationConfig()))

MALFORMED = {
    "str": "hello",
    "none": None,
    "int": 7,
    "list": [b"\x80"],
    "empty": b"",
    "invalid msgpack": b"\xc1",
    "truncated": _GOOD_REQ[:-5],
    "trailing data": _GOOD_REQ + b"\x00",
    "not a map": _body([1, 2, 3]),
    "bare string": _body("gen_req"),
    "missing payload": _body({"type": "ack", "v": PROTOCOL_VERSION}),
    "extra key": _body({"type": "ack", "v": PROTOCOL_VERSION, "payload": {}, "x": 1}),
    "bytes keys": _body({b"type": "ack", b"v": PROTOCOL_VERSION, b"payload": {}}),
    "int keys": _body({1: 2}),
    "wrong version": _env("ack", {}, v=PROTOCOL_VERSION + 1),
    "version as str": _env("ack", {}, v=str(PROTOCOL_VERSION)),
    "version as bool": _env("ack", {}, v=True),
    "unknown type": _env("launch_missiles", {}),
    "type not str": _env(["ack"], {}),
    "control payload not map": _env("ack", [1]),
    "control payload bytes key": _env("ack", {b"k": 1}),
    "ext type": _body({"type": "ack", "v": PROTOCOL_VERSION, "payload": {"t": msgpack.ExtType(5, b"xx")}}),
    "gen_req not map": _env("gen_req", [1]),
    "gen_req missing key": _env("gen_req", {k: v for k, v in _req_payload().items() if k != "session_id"}),
    "gen_req extra key": _env("gen_req", _req_payload(extra=1)),
    "ids as list of ints": _env("gen_req", _req_payload(input_ids=[1, 2, 3])),
    "ids wrong dtype": _env("gen_req", _req_payload(input_ids=_arr(np.arange(4, dtype="<i8"), "int64"))),
    "ids float32": _env("gen_req", _req_payload(input_ids=_arr(np.arange(4, dtype="<f4"), "float32"))),
    "ids ragged bytes": _env("gen_req", _req_payload(input_ids={"dtype": "int32", "data": b"\x01\x02\x03"})),
    "ids data str": _env("gen_req", _req_payload(input_ids={"dtype": "int32", "data": "abcd"})),
    "ids extra key": _env("gen_req", _req_payload(input_ids={"dtype": "int32", "data": b"", "shape": [0]})),
    "qid not str": _env("gen_req", _req_payload(qid=5)),
    "session bytes": _env("gen_req", _req_payload(session_id=b"s")),
    "gconfig unknown key": _env("gen_req", _req_payload(gconfig={**dataclasses.asdict(GenerationConfig()), "beam": 2})),
    "gconfig bool n": _env("gen_req", _req_payload(gconfig={**dataclasses.asdict(GenerationConfig()), "n": True})),
    "gconfig str temp": _env("gen_req", _req_payload(gconfig={**dataclasses.asdict(GenerationConfig()), "temperature": "hot"})),
    "gconfig stop floats": _env("gen_req", _req_payload(gconfig={**dataclasses.asdict(GenerationConfig()), "stop_token_ids": [1.5]})),
    "gen_resp bad reason": _env("gen_resp", {"qid": "q", "error": None, "samples": [{
        "output_ids": _arr(np.zeros(1, "<i4"), "int32"), "output_logprobs": _arr(np.zeros(1, "<f4"), "float32"),
        "output_versions": _arr(np.zeros(1, "<i4"), "int32"), "finish_reason": "eos"}]}),
    "gen_resp ragged sample": _env("gen_resp", {"qid": "q", "error": None, "samples": [{
        "output_ids": _arr(np.zeros(2, "<i4"), "int32"), "output_logprobs": _arr(np.zeros(1, "<f4"), "float32"),
        "output_versions": _arr(np.zeros(2, "<i4"), "int32"), "finish_reason": "stop"}]}),
    "gen_resp samples not list": _env("gen_resp", {"qid": "q", "error": None, "samples": {}}),
    "gen_resp error int": _env("gen_resp", {"qid": "q", "error": 3, "samples": []}),
    "traj empty": _env("traj", []),
    "traj not list": _env("traj", {}),
}


def _nested(depth: int) -> dict:
    d: dict = {"x": None}
    for _ in range(depth):
        d = {"x": d}
    return d


def _traj_wire(**over) -> bytes:
    p = msgpack.unpackb(encode("traj", [_traj(4)]))["payload"]
    p[0].update(over)
    return _env("traj", p)


MALFORMED.update(
    {
        "traj mask int32": _traj_wire(loss_mask=_arr(np.zeros(4, "<i4"), "int32")),
        "traj ragged": _traj_wire(logprobs=_arr(np.zeros(3, "<f4"), "float32")),
        "traj reward str": _traj_wire(reward="1"),
        "traj reward bool": _traj_wire(reward=True),
        "traj group_id int": _traj_wire(group_id=1),
        "traj turn_rewards str": _traj_wire(turn_rewards=["a"]),
        "traj turn_discount str": _traj_wire(turn_discount="0"),
        "traj turn_discount above 1": _traj_wire(turn_discount=2.0),
        "traj turn_discount nan": _traj_wire(turn_discount=float("nan")),
        "traj spans not list": _traj_wire(policy_spans="white"),
        "traj span float": _traj_wire(policy_spans=[["white", 1.5, 3]]),
        "traj span bool": _traj_wire(policy_spans=[["white", True, 3]]),
        "traj span name int": _traj_wire(policy_spans=[[1, 1, 3]]),
        "traj span short": _traj_wire(policy_spans=[["white", 1]]),
        "traj span outside": _traj_wire(policy_spans=[["white", 1, 9]]),
        "traj spans overlap": _traj_wire(policy_spans=[["a", 0, 3], ["b", 2, 4]]),
        "traj policy_rewards key int": _traj_wire(policy_rewards={1: 1.0}),
        "traj policy_rewards str": _traj_wire(policy_rewards={"a": "win"}),
        "traj metadata bytes": _traj_wire(metadata={"b": b"x"}),
        "traj metadata list": _traj_wire(metadata=[1]),
        "traj metadata deep": _traj_wire(metadata=_nested(40)),
        "traj missing key": _env("traj", [{k: v for k, v in msgpack.unpackb(encode("traj", [_traj(1)]))["payload"][0].items() if k != "metadata"}]),
    }
)


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_raises(case):
    with pytest.raises(MalformedMessage) as ei:
        decode(MALFORMED[case])
    assert isinstance(ei.value, ValueError) and 0 < len(str(ei.value)) < 300


def test_oversize_rejected_before_parsing():
    frame = encode("gen_req", GenerateRequest("q", np.arange(1000), GenerationConfig()))
    decode(frame, max_bytes=len(frame))
    with pytest.raises(MalformedMessage, match="exceeds"):
        decode(frame, max_bytes=len(frame) - 1)


def test_huge_declared_lengths_rejected():
    # a bin32 header claiming 2 GiB followed by nothing, and an array header claiming 4 billion entries
    for frame in (b"\xc6\x7f\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff"):
        with pytest.raises(MalformedMessage):
            decode(frame)


def test_bytearray_and_memoryview_accepted():
    assert decode(bytearray(_GOOD_REQ))[0] == "gen_req"
    assert decode(memoryview(_GOOD_REQ))[0] == "gen_req"


def test_fuzz_only_malformed_message_escapes():
    rng = random.Random(0)
    frames = [encode("gen_req", GenerateRequest("q", [1, 2], GenerationConfig())), encode("traj", [_traj(3, a=[1])]),
              encode("gen_resp", GenerateResponse("q", [_sample(2)])), encode("heartbeat", {"k": [1, {"x": 2}]})]
    for _ in range(1500):
        f = bytearray(rng.choice(frames))
        op = rng.random()
        if op < 0.4:
            for _ in range(rng.randint(1, 3)):
                f[rng.randrange(len(f))] = rng.randrange(256)
        elif op < 0.7:
            f = f[: rng.randrange(len(f))]
        else:
            f = bytearray(rng.randbytes(rng.randint(0, 64)))
        try:
            decode(bytes(f))
        except MalformedMessage:
            pass


# ------------------------------------------------------------------------------------------------ HMAC


def test_hmac():
    secret = b"s3cret-shared-by-the-run"
    req = GenerateRequest("q", np.arange(5), GenerationConfig())
    frame = encode("gen_req", req, secret=secret)
    assert len(frame) == len(encode("gen_req", req)) + 24 + 32  # + the replay stamp + the tag
    _, out = decode(frame, secret=secret)
    np.testing.assert_array_equal(out.input_ids, req.input_ids)

    with pytest.raises(MalformedMessage, match="HMAC"):
        decode(frame, secret=b"wrong secret")
    with pytest.raises(MalformedMessage, match="HMAC"):
        decode(encode("gen_req", req), secret=secret)  # no tag
    with pytest.raises(MalformedMessage):
        decode(b"\x00" * 10, secret=secret)  # too short for a tag
    for i in (0, len(frame) // 2, len(frame) - 1):  # a flipped byte in the body or the tag
        bad = bytearray(frame)
        bad[i] ^= 0x01
        with pytest.raises(MalformedMessage, match="HMAC"):
            decode(bytes(bad), secret=secret)
    with pytest.raises(MalformedMessage):
        decode(frame)  # a tagged frame read without the secret: trailing bytes after the msgpack body

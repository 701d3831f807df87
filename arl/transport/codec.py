"""Wire codec: versioned msgpack envelopes, token arrays as raw little-endian bytes, optional HMAC.

Frame layout
    body  = msgpack({"type": str, "v": PROTOCOL_VERSION, "payload": <payload>})
    frame = body                      (no secret)
    frame = body + stamp + HMAC-SHA256(secret, body + stamp)   (with a secret)

``stamp`` (24 bytes: sender id, sequence number; ``arl.transport.replay``) lets a receiver refuse a replayed frame.

A zmq message carries one or more frames (a batch: ``arl.transport.sockets`` sends what one event-loop iteration
queued for a peer as one message); each frame is a whole envelope, encoded, tagged and decoded on its own.

Arrays travel as ``{"dtype": "int32" | "float32" | "int8", "data": <bin, little-endian>}``; a decoded array is a
read-only ``np.frombuffer`` view of the received bytes (copy it before writing into it).

Typed messages (``encode`` takes, ``decode`` returns, the dataclass from ``arl.api.types``):

    "gen_req"   GenerateRequest   {"qid", "input_ids": arr[int32], "gconfig": {GenerationConfig fields},
                                   "session_id": str | None, "policy": str | None}
    "gen_resp"  GenerateResponse  {"qid", "samples": [{"output_ids": arr[int32], "output_logprobs": arr[float32],
                                   "output_versions": arr[int32], "finish_reason"}], "error": str | None}
    "traj"      list[Trajectory]  [{"input_ids": arr[int32], "loss_mask": arr[int8], "logprobs": arr[float32],
                                   "versions": arr[int32], "reward": float, "group_id": str,
                                   "turn_rewards": [float], "metadata": {str: msgpack-safe},
                                   "turn_discount": float in [0, 1] | None,
                                   "policy_spans": [[str, int, int]], "policy_rewards": {str: float}}]
                                  (non-empty group)

Control messages (``CONTROL_TYPES``) carry a plain map with str keys, validated only as a map; ``None`` encodes as
``{}``.

``decode`` raises ``MalformedMessage`` (a ValueError with a short reason) for anything a peer could get wrong;
``encode`` raises ``TypeError`` / ``ValueError`` for programming errors on the sending side (wrong object for the
type, unknown type, metadata that msgpack cannot carry faithfully). The codec checks field *types* only:
semantic checks (e.g. ``GenerationConfig.validate()``) belong to the receiver, which can answer with an error.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, Optional

import msgpack
import numpy as np

from arl.api.types import (FINISH_REASONS, GenerateRequest, GenerateResponse, GenerationConfig, SampleOutput, Trajectory,
                           checked_policy_rewards, checked_policy_spans, checked_turn_discount)
from arl.transport.replay import STAMP_SIZE, ReplayGuard, fresh_stamp

__all__ = ["PROTOCOL_VERSION", "DEFAULT_MAX_BYTES", "TAG_SIZE", "TYPED_TYPES", "CONTROL_TYPES", "ENV_TYPES",
           "ROUTE_TYPES", "MESSAGE_TYPES",
           "MalformedMessage", "ReplayedMessage", "encode", "decode"]

# a peer of another version is refused by name, not by keys. 2: "traj" carries turn_discount; 3: "gen_req" carries
# policy, "traj" policy_spans and policy_rewards (several policies, docs/multi_policy.md); 4: "update_weights" and
# "weights_loaded" carry policy, "addresses" policy_learners (trainable listed policies)
PROTOCOL_VERSION = 4
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
TAG_SIZE = 32  # HMAC-SHA256 digest size

TYPED_TYPES = frozenset({"gen_req", "gen_resp", "traj"})
CONTROL_TYPES = frozenset({"register", "heartbeat", "lookup", "addresses", "gate_acquire", "gate_grant", "group_done",
                           "weights_published", "update_weights", "weights_loaded", "prune_weights", "gen_abort",
                           "metrics", "shutdown", "ack", "error", "eval_done", "eval", "groups_dropped",
                           "worker_lost", "worker_back", "learner_restarted", "join_weight_group", "open_weight_group",
                           "send_weights", "group_received", "prompt_settled", "worker_draining", "scale", "scaled",
                           "leaving", "drain", "adopt_streams"})
# env servers' calls and replies (arl/rollout/env_server.py): plain maps like control messages ({"calls": [...]},
# {"replies": [...]}: one frame, one HMAC, per batch), between a rollout worker and an env server only (the
# controller never sees them, so they have no class in messages.py)
ENV_TYPES = frozenset({"env_calls", "env_replies"})
# the routing view (arl/inference/routing_feed.py, arl/rollout/routing.py): a rollout worker's client subscribes to
# an inference server over its request DEALER ("route_sub"), the server answers every publish interval with its load
# and the change of its cached prefix blocks ("route_stats": hashes as raw uint64 bytes); plain maps like env calls
ROUTE_TYPES = frozenset({"route_sub", "route_stats"})
_PLAIN_TYPES = ENV_TYPES | ROUTE_TYPES  # plain maps that are not control messages
MESSAGE_TYPES = TYPED_TYPES | CONTROL_TYPES | _PLAIN_TYPES

_METADATA_MAX_DEPTH = 32


class MalformedMessage(ValueError):
    """A frame that cannot be accepted; ``str(exc)`` is a short reason."""


class ReplayedMessage(MalformedMessage):
    """An authentic frame refused by the receiver's `ReplayGuard` (seen before, or too old); sockets count it
    as ``replayed``."""


# --------------------------------------------------------------------------------------------- arrays

_WIRE_DTYPES = {"int32": np.dtype("<i4"), "float32": np.dtype("<f4"), "int8": np.dtype("i1")}
_I32, _F32, _I8 = _WIRE_DTYPES["int32"], _WIRE_DTYPES["float32"], _WIRE_DTYPES["int8"]
_DTYPE_NAMES = {v: k for k, v in _WIRE_DTYPES.items()}


def _arr_out(a: np.ndarray, dtype: np.dtype) -> dict:
    if type(a) is not np.ndarray or a.dtype != dtype or a.ndim != 1 or not a.flags.c_contiguous:
        a = np.ascontiguousarray(np.asarray(a, dtype=dtype).reshape(-1))
    # memoryview: msgpack copies straight from the array's buffer into the frame (no intermediate bytes)
    return {"dtype": _DTYPE_NAMES[dtype], "data": memoryview(a)}


def _arr_in(obj: Any, dtype: np.dtype, field: str) -> np.ndarray:
    if type(obj) is not dict or len(obj) != 2:
        raise MalformedMessage(f"{field}: array must be a map {{dtype, data}}")
    name = obj.get("dtype")
    data = obj.get("data")
    if type(data) is not bytes:
        raise MalformedMessage(f"{field}: array data must be bin")
    if _WIRE_DTYPES.get(name) is not dtype:  # type: ignore[arg-type]
        raise MalformedMessage(f"{field}: dtype must be {_DTYPE_NAMES[dtype]}, got {name!r}")
    if len(data) % dtype.itemsize:
        raise MalformedMessage(f"{field}: data length {len(data)} is not a multiple of {dtype.itemsize}")
    return np.frombuffer(data, dtype=dtype)


_SAMPLE_ARRAYS = {"output_ids": _I32, "output_logprobs": _F32, "output_versions": _I32}
_TRAJ_ARRAYS = {"input_ids": _I32, "loss_mask": _I8, "logprobs": _F32, "versions": _I32}


def _arrays_out(obj: Any, spec: dict[str, np.dtype]) -> dict:
    return {k: _arr_out(getattr(obj, k), dtype) for k, dtype in spec.items()}


def _arrays_in(p: dict, spec: dict[str, np.dtype], what: str) -> dict[str, np.ndarray]:
    """The arrays named in `spec`, checked to share one length."""
    arrays = {k: _arr_in(p[k], dtype, k) for k, dtype in spec.items()}
    if len({len(a) for a in arrays.values()}) > 1:
        raise MalformedMessage(f"{what} arrays differ in length")
    return arrays


def _build(cls: type, fields: dict) -> Any:
    """Instantiate a validated dataclass without re-running ``__post_init__`` (its conversions and checks were
    done here already, on arrays that have the right dtype). tests/transport check that the wire keys match
    ``dataclasses.fields`` so a new field cannot be silently left unset."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


# --------------------------------------------------------------------------------------------- scalars


def _str(obj: Any, field: str, nullable: bool = False) -> Optional[str]:
    """`obj`, checked to be a str (or, if `nullable`, None)."""
    if type(obj) is not str and not (nullable and obj is None):
        raise MalformedMessage(f"{field}: expected str{' or nil' if nullable else ''}")
    return obj


def _float(obj: Any, field: str) -> float:
    if type(obj) in (float, int):  # exact types: a bool is not a number here
        return float(obj)
    raise MalformedMessage(f"{field}: expected a number")


def _keys(obj: Any, keys: frozenset, what: str) -> None:
    if type(obj) is not dict:
        raise MalformedMessage(f"{what}: expected a map")
    if obj.keys() != keys:
        missing = sorted(keys - obj.keys())
        extra = sorted(str(k)[:40] for k in obj.keys() - keys)[:5]
        parts = ([f"missing keys {missing}"] if missing else []) + ([f"unexpected keys {extra}"] if extra else [])
        raise MalformedMessage(f"{what}: {', '.join(parts)}")


# --------------------------------------------------------------------------------------------- GenerationConfig

_GCONFIG_TYPES: dict[str, tuple] = {"n": (int,), "max_new_tokens": (int,), "min_new_tokens": (int,),
                                    "temperature": (float, int), "top_p": (float, int), "top_k": (int,),
                                    "greedy": (bool,), "stop_token_ids": (list,)}
_GCONFIG_KEYS = frozenset(_GCONFIG_TYPES)


def _check_gconfig_dict(d: dict, err: type[Exception]) -> None:
    for k, types in _GCONFIG_TYPES.items():
        if type(d[k]) not in types:  # exact types: a bool is not an int here
            raise err(f"gconfig.{k}: expected {'/'.join(t.__name__ for t in types)}, got {type(d[k]).__name__}")
    for t in d["stop_token_ids"]:
        if type(t) is not int:
            raise err("gconfig.stop_token_ids: expected ints")


def _gconfig_out(g: GenerationConfig) -> dict:
    d = {"n": g.n, "max_new_tokens": g.max_new_tokens, "min_new_tokens": g.min_new_tokens,
         "temperature": float(g.temperature), "top_p": float(g.top_p), "top_k": g.top_k, "greedy": g.greedy,
         "stop_token_ids": [int(t) for t in g.stop_token_ids]}
    _check_gconfig_dict(d, TypeError)
    return d


def _gconfig_in(d: Any) -> GenerationConfig:
    _keys(d, _GCONFIG_KEYS, "gconfig")
    _check_gconfig_dict(d, MalformedMessage)
    return GenerationConfig(**d)


# --------------------------------------------------------------------------------------------- gen_req / gen_resp

_GEN_REQ_KEYS = frozenset({"qid", "input_ids", "gconfig", "session_id", "policy"})
_SAMPLE_KEYS = frozenset({*_SAMPLE_ARRAYS, "finish_reason"})
_GEN_RESP_KEYS = frozenset({"qid", "samples", "error"})


def _expect(obj: Any, cls: type, what: str) -> None:
    """Sender side: `what` takes `cls` objects only (a programming error otherwise)."""
    if not isinstance(obj, cls):
        raise TypeError(f"{what} needs a {cls.__name__}, got {type(obj).__name__}")


def _gen_req_out(r: Any) -> dict:
    if not isinstance(r, GenerateRequest):  # _expect's check, inline on the per-request path
        _expect(r, GenerateRequest, "gen_req")
    if (type(r.qid) is not str or (r.session_id is not None and type(r.session_id) is not str)
            or (r.policy is not None and type(r.policy) is not str)):
        raise TypeError("GenerateRequest.qid must be str and session_id and policy str or None")
    return {"qid": r.qid, "input_ids": _arr_out(r.input_ids, _I32), "gconfig": _gconfig_out(r.gconfig),
            "session_id": r.session_id, "policy": r.policy}


def _gen_req_in(p: Any) -> GenerateRequest:
    _keys(p, _GEN_REQ_KEYS, "gen_req")
    return _build(GenerateRequest, {"qid": _str(p["qid"], "qid"),
                                    "input_ids": _arr_in(p["input_ids"], _I32, "input_ids"),
                                    "gconfig": _gconfig_in(p["gconfig"]),
                                    "session_id": _str(p["session_id"], "session_id", nullable=True),
                                    "policy": _str(p["policy"], "policy", nullable=True)})


def _gen_resp_out(r: Any) -> dict:
    if not isinstance(r, GenerateResponse):
        _expect(r, GenerateResponse, "gen_resp")
    if type(r.qid) is not str or (r.error is not None and type(r.error) is not str):
        raise TypeError("GenerateResponse.qid must be str and error str or None")
    samples = []
    for s in r.samples:
        if not isinstance(s, SampleOutput):
            _expect(s, SampleOutput, "GenerateResponse.samples")
        # _SAMPLE_ARRAYS spelled out: a generic _arrays_out (comprehension + getattr) costs more per response
        samples.append({"output_ids": _arr_out(s.output_ids, _I32),
                        "output_logprobs": _arr_out(s.output_logprobs, _F32),
                        "output_versions": _arr_out(s.output_versions, _I32), "finish_reason": s.finish_reason})
    return {"qid": r.qid, "samples": samples, "error": r.error}


def _sample_in(s: Any) -> SampleOutput:
    _keys(s, _SAMPLE_KEYS, "sample")
    reason = s["finish_reason"]
    if reason not in FINISH_REASONS or type(reason) is not str:
        raise MalformedMessage(f"finish_reason must be one of {FINISH_REASONS}")
    # _SAMPLE_ARRAYS spelled out (as in _gen_resp_out): this runs once per response
    ids = _arr_in(s["output_ids"], _I32, "output_ids")
    logp = _arr_in(s["output_logprobs"], _F32, "output_logprobs")
    ver = _arr_in(s["output_versions"], _I32, "output_versions")
    if not len(ids) == len(logp) == len(ver):
        raise MalformedMessage("sample arrays differ in length")
    return _build(SampleOutput, {"output_ids": ids, "output_logprobs": logp, "output_versions": ver,
                                 "finish_reason": reason})


def _gen_resp_in(p: Any) -> GenerateResponse:
    _keys(p, _GEN_RESP_KEYS, "gen_resp")
    samples = p["samples"]
    if type(samples) is not list:
        raise MalformedMessage("samples: expected an array")
    return _build(GenerateResponse, {"qid": _str(p["qid"], "qid"), "samples": [_sample_in(s) for s in samples],
                                     "error": _str(p["error"], "error", nullable=True)})


# --------------------------------------------------------------------------------------------- traj

_TRAJ_KEYS = frozenset({*_TRAJ_ARRAYS, "reward", "group_id", "turn_rewards", "metadata", "turn_discount",
                        "policy_spans", "policy_rewards"})
_META_SCALARS = (str, int, float, bool, type(None))


def _check_tree(obj: Any, path: str, err: type[Exception], seqs: tuple[type, ...],
                scalars: Optional[tuple[type, ...]] = _META_SCALARS, depth: int = 0) -> None:
    """Maps anywhere in `obj` need str keys (the receiver's strict_map_key would reject the whole frame) and nesting
    stops at _METADATA_MAX_DEPTH; other values must be `scalars` (None: any, left to msgpack, which raises
    TypeError on what it cannot pack)."""
    t = type(obj)
    if t is not dict and t not in seqs:
        if scalars is not None and t not in scalars:
            raise err(f"{path}: {t.__name__} is not msgpack-safe (use str/int/float/bool/None/list/dict)")
        return
    if depth >= _METADATA_MAX_DEPTH:
        raise err(f"{path}: nested deeper than {_METADATA_MAX_DEPTH}")
    # leaves are checked here, not by a call each (most of a control message's or an env batch's nodes are leaves)
    if t is dict:
        for k, v in obj.items():
            if type(k) is not str:
                raise err(f"{path}: map keys must be str, got {type(k).__name__} {k!r:.40}")
            tv = type(v)
            if tv is dict or tv in seqs:
                _check_tree(v, f"{path}.{k}", err, seqs, scalars, depth + 1)
            elif scalars is not None and tv not in scalars:
                raise err(f"{path}.{k}: {tv.__name__} is not msgpack-safe (use str/int/float/bool/None/list/dict)")
        return
    for i, v in enumerate(obj):
        tv = type(v)
        if tv is dict or tv in seqs:
            _check_tree(v, f"{path}[{i}]", err, seqs, scalars, depth + 1)
        elif scalars is not None and tv not in scalars:
            raise err(f"{path}[{i}]: {tv.__name__} is not msgpack-safe (use str/int/float/bool/None/list/dict)")


def _traj_out(group: Any) -> list:
    if isinstance(group, Trajectory):
        raise TypeError("traj needs a list of Trajectory (a whole group), got one Trajectory")
    if not isinstance(group, (list, tuple)) or not group:
        raise TypeError("traj needs a non-empty list of Trajectory")
    out = []
    for t in group:
        _expect(t, Trajectory, "traj")
        if type(t.group_id) is not str:
            raise TypeError("Trajectory.group_id must be str")
        turn_rewards = [float(r) for r in t.turn_rewards]
        if type(t.metadata) is not dict:
            raise TypeError("Trajectory.metadata must be a dict")
        _check_tree(t.metadata, "metadata", TypeError, (list, tuple))
        out.append({**_arrays_out(t, _TRAJ_ARRAYS), "reward": float(t.reward), "group_id": t.group_id,
                    "turn_rewards": turn_rewards, "metadata": t.metadata,
                    "turn_discount": checked_turn_discount(t.turn_discount),
                    "policy_spans": [[name, a, b] for name, a, b in checked_policy_spans(t.policy_spans,
                                                                                        len(t.input_ids))],
                    "policy_rewards": {k: float(v) for k, v in checked_policy_rewards(t.policy_rewards).items()}})
    return out


def _one_traj_in(p: Any) -> Trajectory:
    _keys(p, _TRAJ_KEYS, "traj")
    arrays = _arrays_in(p, _TRAJ_ARRAYS, "trajectory")
    tr = p["turn_rewards"]
    if type(tr) is not list:
        raise MalformedMessage("turn_rewards: expected an array")
    meta = p["metadata"]
    if type(meta) is not dict:
        raise MalformedMessage("metadata: expected a map")
    _check_tree(meta, "metadata", MalformedMessage, (list,))
    prew = p["policy_rewards"]
    if type(prew) is not dict or any(type(k) is not str for k in prew):
        raise MalformedMessage("policy_rewards: expected a map of str -> number")
    try:  # the spans' types and bounds, as the Trajectory itself checks them
        spans = checked_policy_spans(p["policy_spans"], len(arrays["input_ids"]))
    except ValueError as e:
        raise MalformedMessage(str(e)) from None
    return _build(Trajectory, {**arrays, "reward": _float(p["reward"], "reward"),
                               "group_id": _str(p["group_id"], "group_id"),
                               "turn_rewards": [_float(r, "turn_rewards") for r in tr], "metadata": meta,
                               "turn_discount": _turn_discount(p["turn_discount"]), "policy_spans": spans,
                               "policy_rewards": {k: _float(v, "policy_rewards") for k, v in prew.items()}})


def _turn_discount(obj: Any) -> Optional[float]:
    """nil, or a number (`_float`'s exact types) in [0, 1]."""
    gamma = None if obj is None else _float(obj, "turn_discount")
    try:
        return checked_turn_discount(gamma)
    except ValueError as e:
        raise MalformedMessage(str(e)) from None


def _traj_in(p: Any) -> list[Trajectory]:
    if type(p) is not list or not p:
        raise MalformedMessage("traj: expected a non-empty array of trajectories")
    return [_one_traj_in(t) for t in p]


# --------------------------------------------------------------------------------------------- envelope

_TO_WIRE = {"gen_req": _gen_req_out, "gen_resp": _gen_resp_out, "traj": _traj_out}
_FROM_WIRE = {"gen_req": _gen_req_in, "gen_resp": _gen_resp_in, "traj": _traj_in}
_ENVELOPE_KEYS = frozenset({"type", "v", "payload"})


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError("ext types are not allowed")


_MACS: dict[bytes, Any] = {}


def _mac(secret: bytes) -> Any:
    """A fresh HMAC-SHA256 for `secret`, copied from one keyed once (keying costs more than a small frame's MAC)."""
    m = _MACS.get(secret)
    if m is None:
        if len(_MACS) >= 16:
            _MACS.clear()
        m = _MACS[secret] = hmac.new(secret, digestmod=hashlib.sha256)
    return m.copy()


def encode(msg_type: str, payload: Any = None, *, secret: Optional[bytes] = None,
           stamp: Optional[bytes] = None) -> bytes:
    """Build one frame. Typed messages take their dataclass (``traj``: a list of Trajectory); control messages
    take a dict (or None for ``{}``). With ``secret``, `stamp` (a socket's `Stamper`; default: a fresh sender's)
    and a 32-byte HMAC-SHA256 tag over body and stamp are appended."""
    conv = _TO_WIRE.get(msg_type)
    if conv is not None:
        payload = conv(payload)
    elif msg_type in CONTROL_TYPES or msg_type in _PLAIN_TYPES:
        if payload is None:
            payload = {}
        elif type(payload) is not dict:
            raise TypeError(f"{msg_type} payload must be a dict, got {type(payload).__name__}")
        else:
            _check_tree(payload, msg_type, TypeError, (list, tuple), scalars=None)
    else:
        raise ValueError(f"unknown message type {msg_type!r}; known: {sorted(MESSAGE_TYPES)}")
    body = msgpack.packb({"type": msg_type, "v": PROTOCOL_VERSION, "payload": payload}, use_bin_type=True)
    if secret is not None:
        stamp = stamp if stamp is not None else fresh_stamp()
        mac = _mac(secret)
        mac.update(body)
        mac.update(stamp)
        return b"".join((body, stamp, mac.digest()))
    return body


def decode(
    frame: Any, *, max_bytes: int = DEFAULT_MAX_BYTES, secret: Optional[bytes] = None,
    guard: Optional[ReplayGuard] = None
) -> tuple[str, Any]:
    """Parse and validate one frame -> ``(type, payload)``; raise MalformedMessage on any defect, and (with
    `secret` and a `guard`) ``ReplayedMessage`` for an authentic frame whose stamp the guard refuses.

    ``payload`` is the dataclass (list of Trajectory for ``traj``) for typed messages, the dict otherwise.
    """
    if type(frame) is not bytes:
        if isinstance(frame, (bytearray, memoryview)):
            frame = bytes(frame)
        else:
            raise MalformedMessage(f"frame must be bytes, got {type(frame).__name__}")
    n = len(frame)
    if n > max_bytes:
        raise MalformedMessage(f"frame of {n} bytes exceeds the {max_bytes}-byte limit")
    if secret is not None:
        if n < TAG_SIZE + STAMP_SIZE + 1:
            raise MalformedMessage("frame too short to carry a stamp and an HMAC tag")
        mac = _mac(secret)
        mac.update(memoryview(frame)[:-TAG_SIZE])
        if not hmac.compare_digest(mac.digest(), frame[-TAG_SIZE:]):
            raise MalformedMessage("HMAC tag does not verify")
        n -= TAG_SIZE + STAMP_SIZE
        if guard is not None:
            why = guard.check(frame[n:n + STAMP_SIZE])
            if why is not None:
                raise ReplayedMessage(why)
        frame = frame[:n]
    if n == 0:
        raise MalformedMessage("empty frame")
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True, max_bin_len=n, max_str_len=n,
                              max_array_len=n, max_map_len=n // 2, max_ext_len=0, ext_hook=_reject_ext)
    except Exception as e:  # msgpack raises ValueError, FormatError, StackError, ExtraData, UnicodeDecodeError...
        raise MalformedMessage(f"invalid msgpack ({type(e).__name__})") from None
    if type(msg) is not dict or msg.keys() != _ENVELOPE_KEYS:  # _keys says what is wrong
        _keys(msg, _ENVELOPE_KEYS, "envelope")
    v = msg["v"]
    if type(v) is not int or v != PROTOCOL_VERSION:
        raise MalformedMessage(f"protocol version {v!r} != {PROTOCOL_VERSION}")
    msg_type = msg["type"]
    if type(msg_type) is not str:
        raise MalformedMessage("message type must be str")
    payload = msg["payload"]
    conv = _FROM_WIRE.get(msg_type)
    if conv is not None:
        try:
            return msg_type, conv(payload)
        except MalformedMessage:
            raise
        except Exception as e:  # dataclass __post_init__ checks, etc.
            raise MalformedMessage(f"{msg_type}: {str(e)[:200]}") from None
    if msg_type not in CONTROL_TYPES and msg_type not in _PLAIN_TYPES:
        raise MalformedMessage(f"unknown message type {msg_type[:40]!r}")
    if type(payload) is not dict:
        raise MalformedMessage(f"{msg_type}: payload must be a map")
    for k in payload:
        if type(k) is not str:
            raise MalformedMessage(f"{msg_type}: payload keys must be str")
    return msg_type, payload

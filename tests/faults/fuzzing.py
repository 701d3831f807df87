"""Malformed frames for each socket type of a running system, and a sender that delivers them.

Every frame here is one the receiving socket must drop and count as malformed (`stats["malformed"]`): random
bytes, truncated msgpack, wrong envelope versions, oversize frames, unknown message types, wrong-shape multipart
messages, and envelopes of a known type whose payload does not fit it. `semantic_*` frames decode fine but carry
requests the receiver must refuse (an over-long prompt, invalid generation parameters, a trajectory with token ids
outside the vocabulary): they are counted by the role, not the socket.
"""

from __future__ import annotations

import random
from typing import Iterator

import msgpack
import numpy as np
import zmq

from arl.api import GenerateRequest, GenerationConfig, Trajectory
from arl.transport.codec import PROTOCOL_VERSION, encode

KINDS = ("random", "truncated", "version", "oversize", "unknown_type", "multipart", "bad_payload", "not_envelope")


def _arr(dtype: str, n: int) -> dict:
    return {"dtype": dtype, "data": np.arange(n, dtype={"int32": "<i4", "float32": "<f4", "int8": "i1"}[dtype])
            .tobytes()}


def _valid_frame(target: str, rng: random.Random) -> bytes:
    if target == "inference":
        return encode("gen_req", GenerateRequest(qid="f", input_ids=[1, 2, 3], gconfig=GenerationConfig(n=2)))
    if target == "learner":
        t = Trajectory(input_ids=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1], logprobs=[0, 0, -1, -1], versions=[-1, -1, 0, 0],
                       reward=1.0, group_id="g")
        return encode("traj", [t])
    return encode("heartbeat", {"role": "rollout", "index": 0, "stats": {"x": rng.random()}})


def _bad_payload(target: str, rng: random.Random) -> bytes:
    """A known type whose payload has missing keys, wrong dtypes or arrays of different lengths."""
    k = rng.randrange(4)
    if target == "inference":
        payloads = [
            {"qid": "x"},
            {"qid": 1, "input_ids": _arr("int32", 3), "gconfig": {}, "session_id": None},
            {"qid": "x", "input_ids": _arr("float32", 3), "gconfig": {}, "session_id": None},
            {"qid": "x", "input_ids": {"dtype": "int32", "data": b"\x00" * 5}, "gconfig": {}, "session_id": None},
        ]
        msg_type = "gen_req"
    elif target == "learner":
        traj = {"input_ids": _arr("int32", 4), "loss_mask": _arr("int8", 3), "logprobs": _arr("float32", 4),
                "versions": _arr("int32", 4), "reward": 1.0, "group_id": "g", "turn_rewards": [], "metadata": {}}
        payloads = [[], [traj], [{**traj, "loss_mask": _arr("int8", 4), "reward": "high"}], {"not": "a list"}]
        msg_type = "traj"
    else:
        payloads = [[1, 2], "str", 7, None]  # control payloads must be maps
        msg_type = rng.choice(["heartbeat", "group_done", "register", "gate_acquire"])
    return msgpack.packb({"type": msg_type, "v": PROTOCOL_VERSION, "payload": payloads[k]}, use_bin_type=True)


def malformed_frame(kind: str, target: str, rng: random.Random, max_bytes: int) -> list[bytes]:
    """One malformed message (a list of frames) of `kind` for a socket of `target` (inference|learner|controller)."""
    if kind == "random":
        return [rng.randbytes(rng.randrange(0, 300))]
    if kind == "truncated":
        good = _valid_frame(target, rng)
        return [good[: rng.randrange(0, len(good))]]
    if kind == "version":
        v = rng.choice([PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, 99, -1, str(PROTOCOL_VERSION),
                        float(PROTOCOL_VERSION), None])
        body = msgpack.unpackb(_valid_frame(target, rng), raw=False)
        body["v"] = v
        return [msgpack.packb(body, use_bin_type=True)]
    if kind == "oversize":  # counted by the socket (up to twice the limit; beyond that libzmq drops the peer)
        return [b"\x81" + rng.randbytes(16) * ((max_bytes + 64) // 16)]
    if kind == "unknown_type":
        return [msgpack.packb({"type": rng.choice(["nope", "gen_reqq", "", "x" * 100]), "v": PROTOCOL_VERSION,
                               "payload": {}}, use_bin_type=True)]
    if kind == "multipart":
        return [_valid_frame(target, rng), rng.randbytes(8)] + ([b""] if rng.random() < 0.5 else [])
    if kind == "bad_payload":
        return [_bad_payload(target, rng)]
    if kind == "not_envelope":
        choices = [msgpack.packb([1, 2, 3]), msgpack.packb(5), msgpack.packb({1: 2}),
                   msgpack.packb({"type": "heartbeat", "v": 1}),  # missing payload
                   b"\x91" * 2000,  # deeply nested arrays
                   msgpack.packb(msgpack.ExtType(5, b"xx")),
                   msgpack.packb({"type": "heartbeat", "v": 1, "payload": {}, "extra": 1})]
        return [rng.choice(choices)]
    raise ValueError(kind)


def frames(target: str, n: int, seed: int, max_bytes: int, oversize_every: int = 100) -> Iterator[tuple[str, list]]:
    """`n` malformed messages cycling through the kinds; oversize ones only every `oversize_every`-th (bandwidth)."""
    rng = random.Random(seed)
    small = [k for k in KINDS if k != "oversize"]
    for i in range(n):
        kind = "oversize" if i % oversize_every == oversize_every - 1 else small[i % len(small)]
        yield kind, malformed_frame(kind, target, rng, max_bytes)


def semantic_frames(target: str, n: int, vocab_size: int, max_context_len: int) -> Iterator[bytes]:
    """Well-formed requests the role must refuse: over-long prompts and invalid generation parameters (inference),
    trajectories with out-of-vocabulary tokens or NaN rewards (learner)."""
    for i in range(n):
        if target == "inference":
            if i % 2:
                req = GenerateRequest(qid=f"long{i}", input_ids=[1] * (max_context_len + 5), gconfig=GenerationConfig())
            else:
                req = GenerateRequest(qid=f"badg{i}", input_ids=[1, 2], gconfig=GenerationConfig(n=1))
                req.gconfig.temperature = -1.0  # invalid; the codec checks types only, the engine refuses it
            yield encode("gen_req", req)
        elif target == "learner":
            ids = [1, 2, vocab_size + 7, 3] if i % 2 else [1, 2, 3, 4]
            reward = 1.0 if i % 2 else float("nan")
            t = Trajectory(input_ids=ids, loss_mask=[0, 0, 1, 1], logprobs=[0, 0, -1, -1], versions=[-1, -1, 0, 0],
                           reward=reward, group_id=f"fuzz{i}")
            yield encode("traj", [t])


def send_all(sock: zmq.Socket, msgs: Iterator, timeout_ms: int = 30_000) -> int:
    """Send every message (a frame or a list of frames) with a blocking send under a timeout; returns the count."""
    sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
    n = 0
    for m in msgs:
        if isinstance(m, tuple):
            m = m[1]
        if isinstance(m, (bytes, bytearray)):
            sock.send(m)
        else:
            sock.send_multipart(m)
        n += 1
    return n

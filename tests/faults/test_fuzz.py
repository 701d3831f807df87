"""Bad input over the wire: a running system takes >= 10,000 malformed frames on each of its socket types (the
inference worker's ROUTER, the learner's PULL, the controller's ROUTER) while it trains, plus requests and
trajectories that decode but must be refused. Nothing crashes, and the run trains exactly the steps it was asked
to, on trajectories from its own rollout workers only."""

from __future__ import annotations

import os
import time

import pytest
import zmq

from arl.transport.codec import decode, encode

from . import fuzzing
from .harness import (Hold, addresses, assert_accounting, assert_no_leftovers, finish, launcher_log, log_text,
                      read_metrics, record, start_run, summary, train_steps, wait_for, wait_malformed_drained)

N_FRAMES = 10_000
N_SEMANTIC = 500
MAX_BYTES = 64 * 1024
STEPS = 6
LINGER_MS = 20_000  # closing a sender must not discard frames a loaded role has not taken yet


@pytest.mark.slow
def test_fuzz_every_socket_while_training(tmp_path, model_cache):
    hold = Hold(str(tmp_path), hold_from=1)  # it trains on (version-0 groups), but cannot finish before the fuzzing
    proc, run_dir = start_run(str(tmp_path), model_cache, [f"total_train_steps={STEPS}",
                                                           f"max_message_bytes={MAX_BYTES}", *hold.args],
                              env=hold.env)
    ctx = zmq.Context()
    socks = []
    sent_all = False
    try:
        def ready() -> bool:
            try:
                a = addresses(run_dir)
            except (OSError, ValueError):
                return False
            return a.get("learner") is not None and None not in a["inference"] and bool(train_steps(run_dir))

        wait_for(ready, proc, what="training to start")
        addr = addresses(run_dir)
        assert all(a.startswith("tcp://127.0.0.1:") for a in [addr["controller"], addr["learner"], *addr["inference"]])
        targets = {"inference": (zmq.DEALER, addr["inference"][0]), "learner": (zmq.PUSH, addr["learner"]),
                   "controller": (zmq.DEALER, addr["controller"])}
        sent: dict[str, int] = {}
        t0 = time.monotonic()
        for i, (target, (kind, address)) in enumerate(targets.items()):
            s = ctx.socket(kind)
            s.setsockopt(zmq.LINGER, LINGER_MS)
            s.connect(address)
            socks.append(s)
            sent[target] = fuzzing.send_all(s, fuzzing.frames(target, N_FRAMES, seed=i, max_bytes=MAX_BYTES))
        # requests that decode but must be refused, with an answer saying why (inference) or a count (learner)
        inf = ctx.socket(zmq.DEALER)
        inf.setsockopt(zmq.LINGER, LINGER_MS)
        inf.connect(addr["inference"][0])
        socks.append(inf)
        fuzzing.send_all(inf, fuzzing.semantic_frames("inference", N_SEMANTIC, vocab_size=1_000_000, max_context_len=256))
        learner = ctx.socket(zmq.PUSH)
        learner.setsockopt(zmq.LINGER, LINGER_MS)
        learner.connect(addr["learner"])
        socks.append(learner)
        fuzzing.send_all(learner, fuzzing.semantic_frames("learner", N_SEMANTIC, vocab_size=1_000_000, max_context_len=256))
        # well-formed control messages from a peer that never registered: must not be acted on ("error" would
        # otherwise stop the run, "group_done" would corrupt the staleness accounting)
        ctl = ctx.socket(zmq.DEALER)
        ctl.setsockopt(zmq.LINGER, LINGER_MS)
        ctl.connect(addr["controller"])
        socks.append(ctl)
        for j in range(300):
            ctl.send(encode(["error", "group_done", "weights_published"][j % 3],
                            {"message": "fuzz", "accepted": True, "reason": "fuzz", "n_traj": 1, "version": 999,
                             "path": "/nonexistent"}))
        # frames over twice the limit: libzmq drops the sending peer's connection (not counted by the socket)
        for target, (kind, address) in targets.items():
            s = ctx.socket(kind)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(address)
            socks.append(s)
            for _ in range(3):
                s.send(b"\x00" * (3 * MAX_BYTES), flags=0)
        replies = []
        deadline = time.monotonic() + 60
        while len(replies) < N_SEMANTIC and time.monotonic() < deadline:
            if inf.poll(1000):
                replies.append(decode(inf.recv()))
        fuzz_s = time.monotonic() - t0
        sent_all = True
        assert len(train_steps(run_dir)) < STEPS
    finally:
        for s in socks:
            s.close()
        ctx.term()  # returns once every frame left (or LINGER_MS passed)
        if sent_all:  # the run goes on only once each socket has dropped every malformed frame sent to it
            wait_malformed_drained(proc, {
                "inference": (lambda: log_text(run_dir, "inference0"), addr["inference"][0], sent["inference"]),
                "learner": (lambda: log_text(run_dir, "learner"), addr["learner"], sent["learner"]),
                "controller": (lambda: launcher_log(proc), addr["controller"], sent["controller"])})
        hold.release()
    code, _, err = finish(proc)
    assert code == 0, err[-5000:]
    assert train_steps(run_dir) == list(range(1, STEPS + 1))
    s = summary(run_dir)
    tr = s["transport"]
    # every malformed frame that reached a socket was dropped and counted there (>= N_FRAMES each)
    assert tr["inference0"]["malformed"] >= N_FRAMES, tr
    assert tr["learner0"]["malformed"] >= N_FRAMES, tr
    assert tr["controller"]["malformed"] >= N_FRAMES, tr
    assert s["transport"]["controller_refused"].get("unknown_peer", 0) >= 300
    # refused requests got a clear error each; invalid trajectories were counted and never trained
    assert len(replies) == N_SEMANTIC
    errors = [r[1].error or "" for r in replies]
    assert all(e for e in errors) and all(r[1].samples == [] for r in replies)
    assert sum("prompt too long" in e for e in errors) == N_SEMANTIC // 2
    assert sum("invalid GenerationConfig" in e for e in errors) == N_SEMANTIC // 2
    assert s["learner"]["invalid_groups"] == N_SEMANTIC
    # nobody crashed or was replaced, and only the run's own groups were trained
    assert s["faults"] == [] and s["rollout_restarts"] == 0
    assert not [m for m in read_metrics(run_dir) if m.get("type") == "worker_lost"]
    assert_accounting(s)
    assert s["learner"]["groups_received"] == s["accepted_groups"]
    assert_no_leftovers(run_dir)
    for name in os.listdir(os.path.join(run_dir, "logs")):
        assert "Traceback" not in log_text(run_dir, name[:-4]), name
    total = sum(sent.values()) + 2 * N_SEMANTIC + 300 + 9
    record("test_fuzz", "malformed frames on every socket", total, run_dir, True, frames_fuzzed=total,
           frames_per_socket=sent, fuzz_seconds=round(fuzz_s, 1),
           malformed_counted={k: v.get("malformed") for k, v in tr.items() if isinstance(v, dict)}, crashes=0)

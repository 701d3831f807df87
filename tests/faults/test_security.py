"""Sockets bind to loopback unless a host is configured; a run reachable from other machines needs a shared secret;
with a secret, a peer without it (or with a wrong one) can neither submit a generate request to an inference worker
nor a trajectory to the learner nor act on the controller: its frames are dropped and counted as malformed."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import zmq

from arl.api import GenerateRequest, GenerationConfig, Trajectory
from arl.config import ConfigError
from arl.transport.security import advertised_address, effective_bind_host, is_loopback, resolve_secret
from arl.transport.codec import decode, encode

from .harness import (MAIN, ROOT, Hold, addresses, assert_accounting, assert_no_leftovers, finish, launcher_log,
                      log_text, record, start_run, summary, train_steps, wait_for, wait_malformed_drained)

SECRET = "s3cret-for-the-fault-test-0123456789"


def test_loopback_and_secret_rules():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.0.0.2")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("node7")
    assert resolve_secret("", "127.0.0.1", env={}) is None
    with pytest.raises(ConfigError, match="shared secret"):
        resolve_secret("", "10.1.2.3", env={})
    assert resolve_secret("", "10.1.2.3", env={"ARL_SECRET": "abc" * 6}) == b"abc" * 6
    assert resolve_secret("cfg-secret-xxxxxxxx", "0.0.0.0", env={"ARL_SECRET": "env"}) == b"cfg-secret-xxxxxxxx"
    assert effective_bind_host("127.0.0.1", env={"ARL_BIND_HOST": "10.0.0.5"}) == "10.0.0.5"
    assert effective_bind_host("10.0.0.6", env={}) == "10.0.0.6"
    assert advertised_address("tcp://127.0.0.1:5") == "tcp://127.0.0.1:5"
    assert not advertised_address("tcp://0.0.0.0:5").startswith("tcp://0.0.0.0")


def test_multi_host_run_without_secret_refuses_to_start():
    env = {"PATH": "/usr/bin:/bin"}
    p = subprocess.run([sys.executable, MAIN, "bind_host=10.1.2.3"], capture_output=True, text=True, timeout=60,
                       cwd=ROOT, env=env)
    assert p.returncode == 2 and "shared secret" in p.stderr and "10.1.2.3" in p.stderr


def _traj(i: int) -> list[Trajectory]:
    """A well-formed, in-vocabulary trajectory group: it would be trained on if it were let in."""
    return [Trajectory(input_ids=[3, 4, 5, 6], loss_mask=[0, 0, 1, 1], logprobs=[0, 0, -1.0, -1.0],
                       versions=[-1, -1, 0, 0], reward=float(j), group_id=f"intruder{i}") for j in range(2)]


@pytest.mark.slow
def test_unauthenticated_peers_cannot_submit_requests_or_trajectories(tmp_path, model_cache):
    steps = 4
    hold = Hold(str(tmp_path), hold_from=1)  # the run cannot finish before the intruders are done
    proc, run_dir = start_run(str(tmp_path), model_cache, [f"secret={SECRET}", f"total_train_steps={steps}",
                                                           *hold.args], env=hold.env)
    ctx = zmq.Context()
    socks = []
    n = 200
    sent_all = False
    try:
        wait_for(lambda: len(train_steps(run_dir)) >= 1, proc, what="the first step")
        addr = addresses(run_dir)
        gen = GenerateRequest(qid="intruder", input_ids=[3, 4, 5], gconfig=GenerationConfig(n=1, max_new_tokens=2))
        # control: the request signed with the run's secret is served (so what follows is refused for the secret)
        ok = ctx.socket(zmq.DEALER)
        ok.setsockopt(zmq.LINGER, 0)
        ok.connect(addr["inference"][0])
        socks.append(ok)
        ok.send(encode("gen_req", gen, secret=SECRET.encode()))
        assert ok.poll(60_000), "an authenticated request got no answer"
        _, resp = decode(ok.recv(), secret=SECRET.encode())
        assert resp.error is None and len(resp.samples) == 1
        replies: dict[str, int] = {}
        for label, key in (("no secret", None), ("wrong secret", b"not-the-secret-0123456789")):
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 20_000)
            dealer.connect(addr["inference"][0])
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 20_000)
            push.connect(addr["learner"])
            ctl = ctx.socket(zmq.DEALER)
            ctl.setsockopt(zmq.LINGER, 20_000)
            ctl.connect(addr["controller"])
            socks += [dealer, push, ctl]
            for i in range(n):
                dealer.send(encode("gen_req", gen, secret=key))
                push.send(encode("traj", _traj(i), secret=key))
            for _ in range(50):  # try to pose as a role, or to stop the run
                ctl.send(encode("register", {"role": "rollout", "index": 0, "pid": 1}, secret=key))
                ctl.send(encode("error", {"message": "stop"}, secret=key))
            got = 0
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:
                if dealer.poll(200):
                    dealer.recv()
                    got += 1
            replies[label] = got
        sent_all = True
        assert len(train_steps(run_dir)) < steps
    finally:
        for s in socks:
            s.close()
        ctx.term()  # every intruder frame left before the run may finish
        if sent_all:  # the frames were sent: the run goes on only once each socket has dropped all of them
            wait_malformed_drained(proc, {
                "inference": (lambda: log_text(run_dir, "inference0"), addr["inference"][0], 2 * n),
                "learner": (lambda: log_text(run_dir, "learner"), addr["learner"], 2 * n),
                "controller": (lambda: launcher_log(proc), addr["controller"], 2 * 100)})
        hold.release()
    code, _, err = finish(proc)
    assert code == 0, err[-5000:]
    assert replies == {"no secret": 0, "wrong secret": 0}
    assert train_steps(run_dir) == list(range(1, steps + 1))
    with open(f"{run_dir}/config.yaml") as f:
        assert SECRET not in f.read()  # the roles got it by environment
    s = summary(run_dir)
    tr = s["transport"]
    assert tr["inference0"]["malformed"] >= 2 * n and tr["learner0"]["malformed"] >= 2 * n
    assert tr["controller"]["malformed"] >= 2 * 100
    assert s["learner"]["groups_received"] == s["accepted_groups"]  # nothing but the run's own groups got in
    assert s["learner"]["invalid_groups"] == 0
    assert_accounting(s)
    assert_no_leftovers(run_dir)
    record("test_security", "unauthenticated requests/trajectories/control frames", 2 * (2 * n + 100), run_dir,
           True, crashes=0, frames_fuzzed=2 * (2 * n + 100))

"""Attacks on the weight data plane (the learner's TCPStore and its groups), like tests/faults/test_security.py for
the ZMQ sockets: the store listens on the configured address only; a value written into it by a peer without the
run's secret (a fake announcement, a fake SGLang outcome) is ignored and counted, never acted on; a peer that takes
a rank in a group (the sender's or a receiver's) cannot prove the secret, so the group is refused before any weight
moves; group names carry a tag no peer can guess."""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Callable

import pytest
import torch

from arl.weights import group as bc
from arl.weights.group import Group, WeightTransferError
from arl.weights.plan import make_plan
from arl.weights.receiver import WeightReceiver
from arl.weights.sender import WeightSender
from arl.weights.strategy import WeightsSettings

SECRET = b"weights-secret-0123456789abcdef"
T = 20.0


def listening(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* writes them) of the sockets listening on `port`."""
    out = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(name):
            continue
        with open(name) as f:
            for line in list(f)[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, _, p = local.rpartition(":")
                if state == "0A" and int(p, 16) == port:
                    out.append(addr)
    return out


def test_the_store_listens_on_the_configured_address_only():
    """TCPStore's server listened on every interface whatever `host` said."""
    sender = WeightSender("127.0.0.1", 0, timeout_s=T)
    try:
        assert listening(sender.port) == ["0100007F"]  # 127.0.0.1, nothing on 0.0.0.0 or ::
        client = bc.store_client("127.0.0.1", sender.port, T)  # still reachable there
        client.set("k", "v")
        assert client.get("k") == b"v"
    finally:
        sender.close()


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_forged_announcement_is_ignored_and_counted_and_the_real_weights_land():
    """A peer that reaches the store writes the next transfer's plan with two same-shaped tensors swapped: without
    the announcement's MAC the receiver would load tensor a's bytes into b and b's into a."""
    sender = WeightSender("127.0.0.1", 0, timeout_s=T, gloo_host="127.0.0.1", secret=SECRET)
    rx = WeightReceiver(sender.spec("g"), timeout_s=T, gloo_host="127.0.0.1", secret=SECRET)
    try:
        t, out = in_thread(rx.join)
        sender.open_group("g", 2)
        t.join(T)
        assert "error" not in out
        sd = {"a": torch.arange(4.0), "b": torch.arange(4.0) + 10}
        plan = make_plan(sd)
        forged = json.loads(json.dumps(plan.to_json()))
        forged["tensors"] = forged["tensors"][::-1]
        attacker = bc.arl_store(bc.store_client("127.0.0.1", sender.port, T), "g")
        attacker.set("arl/xfer/0", json.dumps({"version": 99, "plan": forged}))  # unsigned
        attacker.set("arl/xfer/0", bc.sign_value(b"a-wrong-secret-0123456789", "g", "arl/xfer/0",
                                              json.dumps({"version": 99, "plan": forged})))
        target = {"a": torch.zeros(4), "b": torch.zeros(4)}
        t, out = in_thread(lambda: rx.receive_into(target))
        deadline = T
        while rx.stats["forged_values"] == 0 and deadline > 0:
            threading.Event().wait(0.05)
            deadline -= 0.05
        assert rx.stats["forged_values"] >= 1  # refused and counted while the real one is not there yet
        sender.send(1, sd, plan=plan)
        t.join(T)
        assert out.get("value") == 1, out
        assert torch.equal(target["a"], sd["a"]) and torch.equal(target["b"], sd["b"])
    finally:
        rx.close()
        sender.close()


def test_a_forged_sglang_outcome_is_not_taken_for_the_servers():
    """An SGLang worker's outcome (`arl/done/<seq>`) decides whether the sender believes the server loaded the
    weights: a value not signed with the secret is ignored and counted; moved to another key it fails too."""
    sender = WeightSender("127.0.0.1", 0, timeout_s=T, secret=SECRET)
    try:
        store = bc.arl_store(bc.store_client("127.0.0.1", sender.port, T), "g")
        store.set("arl/done/0", json.dumps({"success": True, "message": "forged"}))
        with pytest.raises(TimeoutError):
            bc.get_signed(store, "g", "arl/done/0", 0.3, SECRET, sender._forged)
        assert sender.stats["forged_values"] >= 1
        good = bc.sign_value(SECRET, "g", "arl/done/0", '{"success": true}')
        assert bc.verify_value(SECRET, "g", "arl/done/0", good) == '{"success": true}'
        assert bc.verify_value(SECRET, "g", "arl/done/1", good) is None  # replayed under the next transfer's key
        assert bc.verify_value(SECRET, "g2", "arl/done/0", good) is None  # or another group's
    finally:
        sender.close()


def test_a_peer_that_takes_the_receivers_rank_is_refused_before_any_weight_moves():
    sender = WeightSender("127.0.0.1", 0, timeout_s=T, gloo_host="127.0.0.1", secret=SECRET)
    try:
        t, out = in_thread(lambda: Group(bc.store_client("127.0.0.1", sender.port, T), "g", 1, 2, timeout_s=T,
                                         gloo_host="127.0.0.1", secret=b"guessed-secret-0123456789abcdef"))
        with pytest.raises(bc.RankNotProven, match=r"rank\(s\) \[1\] could not prove the run's secret"):
            sender.open_group("g", 2)
        t.join(T)
        assert isinstance(out.get("error"), bc.RankNotProven)  # and the intruder cannot trust the sender either
        assert sender.stats["ranks_refused"] == 1 and sender.groups == []
        with pytest.raises(WeightTransferError, match="no open group"):
            sender.send(1, {"a": torch.ones(2)}, groups=["g"])
    finally:
        sender.close()


def test_a_peer_that_takes_the_senders_rank_cannot_feed_weights_to_a_receiver():
    """Anyone who reaches the store can also pose as rank 0 of a group a receiver was told to join."""
    sender = WeightSender("127.0.0.1", 0, timeout_s=T, gloo_host="127.0.0.1", secret=SECRET)
    rx = WeightReceiver(sender.spec("g"), timeout_s=T, gloo_host="127.0.0.1", secret=SECRET)
    try:
        t, out = in_thread(lambda: Group(bc.store_client("127.0.0.1", sender.port, T), "g", 0, 2, timeout_s=T,
                                         gloo_host="127.0.0.1", secret=b"guessed-secret-0123456789abcdef"))
        with pytest.raises(bc.RankNotProven, match=r"rank\(s\) \[0\]"):
            rx.join()
        t.join(T)
        assert rx.group is None
    finally:
        rx.close()
        sender.close()


def test_without_a_secret_groups_form_as_before():
    """A loopback run has no secret: no handshake, unsigned values (the store is on loopback only)."""
    sender = WeightSender("127.0.0.1", 0, timeout_s=T, gloo_host="127.0.0.1")
    rx = WeightReceiver(sender.spec("g"), timeout_s=T, gloo_host="127.0.0.1")
    try:
        t, _ = in_thread(rx.join)
        sender.open_group("g", 2)
        t.join(T)
        target = {"a": torch.zeros(3)}
        t, out = in_thread(lambda: rx.receive_into(target))
        sender.send(4, {"a": torch.ones(3)})
        t.join(T)
        assert out.get("value") == 4 and torch.equal(target["a"], torch.ones(3))
    finally:
        rx.close()
        sender.close()


@pytest.mark.asyncio
async def test_weight_group_names_cannot_be_guessed(tmp_path):
    """Group names were `arl-weights-s{i}-{n}`: anyone could name the next one and join it first."""
    from tests.controller.test_controller_broadcast import STORE, groups, sent
    from tests.controller.test_controller_faults import make_controller

    names = []
    for _ in range(2):  # two runs with the same secret
        ctl = make_controller(tmp_path, num_inference=1, weights_settings=WeightsSettings("broadcast"), secret=SECRET)
        await ctl._dispatch(b"i0", "register", {"role": "inference", "index": 0, "address": "tcp://i:0"})
        await ctl._dispatch(b"L", "register", {"role": "learner", "address": "tcp://l:1", "weights_store": STORE})
        names.append(groups(sent(ctl, "open_weight_group"))[0])
        ctl.reporter.close()
    for n in names:
        base, _, tag = n.rpartition("-")
        assert base == "arl-weights-s0-1" and len(tag) == 32 and int(tag, 16) >= 0
    assert names[0] != names[1]

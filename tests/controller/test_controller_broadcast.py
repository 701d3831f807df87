"""The controller with `weights.transport=broadcast`, without sockets or processes: a weight group per inference
server incarnation once both ends registered, and every `update_weights` it sends paired with a `send_weights` to
the learner."""

from __future__ import annotations

import pytest

from arl.weights.strategy import WeightsSettings

from .fakes import FakeRouter
from .test_controller_faults import make_controller

STORE = "127.0.0.1:29555"


def sent(ctl, *types: str) -> list[tuple[bytes, str, dict]]:
    out = [s for s in ctl.router.sent if s[1] in types]
    ctl.router.sent.clear()
    return out


def groups(messages) -> dict[int, str]:
    return {p["server"]: p["name"] for _, t, p in messages if t == "open_weight_group"}


@pytest.mark.asyncio
async def test_groups_form_once_both_ends_registered_and_updates_go_to_both(tmp_path):
    ctl = make_controller(tmp_path, num_inference=2, weights_settings=WeightsSettings("broadcast"))
    await ctl._dispatch(b"i0", "register", {"role": "inference", "index": 0, "address": "tcp://i:0"})
    assert sent(ctl, "open_weight_group", "join_weight_group") == []  # no learner yet
    await ctl._dispatch(b"L", "register", {"role": "learner", "address": "tcp://l:1", "weights_store": STORE})
    await ctl._dispatch(b"i1", "register", {"role": "inference", "index": 1, "address": "tcp://i:1"})
    msgs = sent(ctl, "open_weight_group", "join_weight_group")
    g = groups(msgs)
    assert set(g) == {0, 1} and len(set(g.values())) == 2
    joins = {p["index"]: p["spec"] for ident, t, p in msgs if t == "join_weight_group"}
    for s in (0, 1):
        assert (b"i0", b"i1")[s] in [ident for ident, t, p in msgs if t == "join_weight_group" and p["index"] == s]
        assert joins[s] == {"master_address": "127.0.0.1", "master_port": 29555, "group_name": g[s],
                            "world_size": 2, "rank": 1, "backend": "gloo"}
    # a published version: update_weights (no path) to each server, one send_weights to the learner naming both
    await ctl._dispatch(b"L", "weights_published", {"version": 1, "path": ""})
    msgs = sent(ctl, "update_weights", "send_weights")
    assert sorted((i, p["version"], p["path"]) for i, t, p in msgs if t == "update_weights") == [
        (b"i0", 1, ""), (b"i1", 1, "")]
    assert [(i, p) for i, t, p in msgs if t == "send_weights"] == [(b"L", {"version": 1, "servers": [0, 1]})]
    # server 0 got v2 by coalescing before v2 was even offered to it: acked, never asked for again
    await ctl._dispatch(b"i0", "weights_loaded", {"version": 2, "index": 0})
    await ctl._dispatch(b"i1", "weights_loaded", {"version": 1, "index": 1})
    await ctl._dispatch(b"L", "weights_published", {"version": 2, "path": ""})
    msgs = sent(ctl, "update_weights", "send_weights")
    assert [(i, t, p["version"]) for i, t, p in msgs] == [(b"i1", "update_weights", 2), (b"L", "send_weights", 2)]
    assert msgs[1][2]["servers"] == [1]
    ctl.reporter.close()


@pytest.mark.asyncio
async def test_a_restarted_server_gets_a_new_group_before_the_newest_weights(tmp_path):
    ctl = make_controller(tmp_path, num_inference=2, num_rollout=1, total_train_steps=10,
                          weights_settings=WeightsSettings("broadcast"), tolerate_inference_loss=True, restart_inference=True,
                          max_inference_restarts=2)
    await ctl._dispatch(b"r0", "register", {"role": "rollout", "index": 0})
    await ctl._dispatch(b"L", "register", {"role": "learner", "address": "tcp://l:1", "weights_store": STORE})
    for i in (0, 1):
        await ctl._dispatch(b"i%d" % i, "register", {"role": "inference", "index": i, "address": f"tcp://i:{i}"})
    first = groups(sent(ctl, "open_weight_group"))
    await ctl._dispatch(b"L", "weights_published", {"version": 1, "path": ""})
    for i in (0, 1):
        await ctl._dispatch(b"i%d" % i, "weights_loaded", {"version": 1, "index": i})
    sent(ctl)
    ctl.launcher.exit("inference1", -9)
    assert await ctl.health.check()
    await ctl._dispatch(b"L", "weights_published", {"version": 2, "path": ""})
    msgs = sent(ctl, "update_weights", "send_weights", "open_weight_group", "join_weight_group")
    assert [(i, t) for i, t, _ in msgs] == [(b"i0", "update_weights"), (b"L", "send_weights")]  # not the dead one
    # the new incarnation registers: a new group first, then the newest version through it
    await ctl._dispatch(b"j1", "register", {"role": "inference", "index": 1, "address": "tcp://i:9"})
    msgs = sent(ctl, "update_weights", "send_weights", "open_weight_group", "join_weight_group")
    assert [(i, t) for i, t, _ in msgs] == [(b"L", "open_weight_group"), (b"j1", "join_weight_group"),
                                            (b"j1", "update_weights"), (b"L", "send_weights")]
    assert msgs[0][2]["name"] != first[1] and msgs[1][2]["spec"]["group_name"] == msgs[0][2]["name"]
    assert msgs[2][2] == {"version": 2, "path": ""} and msgs[3][2] == {"version": 2, "servers": [1]}
    ctl.reporter.close()


def test_disk_transport_sends_nothing_to_the_learner_about_groups(tmp_path):
    import asyncio

    async def go() -> list:
        ctl = make_controller(tmp_path)
        ctl.router = FakeRouter()
        await ctl._dispatch(b"L", "register", {"role": "learner", "address": "tcp://l:1"})
        await ctl._dispatch(b"i0", "register", {"role": "inference", "index": 0, "address": "tcp://i:0"})
        await ctl._dispatch(b"L", "weights_published", {"version": 1, "path": "/w/v1.safetensors"})
        ctl.reporter.close()
        return [(i, t, p) for i, t, p in ctl.router.sent if t not in ("ack", "addresses", "eval", "gate_grant")]

    assert asyncio.run(go()) == [(b"i0", "update_weights", {"version": 1, "path": "/w/v1.safetensors"})]

"""A role's identity is bound at registration: a second peer that registers as a role that is registered and alive
(a replayed or forged `register`) is refused and counted, and commands keep going to the role; a new incarnation
of a role that died registers as before."""

from __future__ import annotations

import pytest

from .test_controller_faults import make_controller


@pytest.mark.asyncio
async def test_a_second_registration_of_a_live_role_is_refused_and_counted(tmp_path):
    ctl = make_controller(tmp_path, num_inference=2, num_rollout=1, total_train_steps=10,
                          tolerate_inference_loss=True, restart_inference=True, max_inference_restarts=2)
    await ctl._dispatch(b"r0", "register", {"role": "rollout", "index": 0})
    await ctl._dispatch(b"L", "register", {"role": "learner", "index": 0, "address": "tcp://l:1"})
    await ctl._dispatch(b"i0", "register", {"role": "inference", "index": 0, "address": "tcp://a:0"})
    await ctl._dispatch(b"i1", "register", {"role": "inference", "index": 1, "address": "tcp://a:1"})
    for key in ({"role": "rollout", "index": 0}, {"role": "inference", "index": 0, "address": "tcp://evil:0"}):
        await ctl._dispatch(b"evil", "register", key)
    assert ctl.control_errors == {"register_taken": 2}
    assert ctl.peers[("rollout", 0)] == b"r0" and ctl.peers[("inference", 0)] == b"i0"
    assert ctl.roster.addresses["inference"][0] == "tcp://a:0" and b"evil" not in ctl.roster.who
    await ctl._dispatch(b"evil", "gate_acquire", {"want": 3})  # still nobody
    assert ctl.control_errors == {"register_taken": 2, "unknown_peer": 1}
    # the same peer registering again (a lost ack) is fine
    await ctl._dispatch(b"r0", "register", {"role": "rollout", "index": 0})
    assert ctl.peers[("rollout", 0)] == b"r0" and ctl.control_errors.get("register_taken") == 2
    # a new incarnation after a death registers under the key
    ctl.launcher.exit("inference1", -9)
    assert await ctl.health.check()
    await ctl._dispatch(b"i1b", "register", {"role": "inference", "index": 1, "address": "tcp://b:1"})
    assert ctl.peers[("inference", 1)] == b"i1b" and ctl.control_errors.get("register_taken") == 2
    ctl.reporter.close()

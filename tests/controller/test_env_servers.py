"""Env servers in the controller's pure pieces: their processes, registration and addresses, silence, and the
restart plan (rollout workers told, the cap)."""

from __future__ import annotations

from arl.api.staleness import StalenessPolicy
from arl.controller.admission import Admission
from arl.controller.diagnosis import describe_stall
from arl.controller.peers import Peers
from arl.controller.recovery import EnvLost, Fatal, plan_failure
from arl.controller.supervision import Supervisor, process_role
from arl.controller.weight_sync import WeightSync
from arl.rollout.staleness import StalenessGate
from arl.transport import messages as m


def sup(**kw) -> Supervisor:
    s = Supervisor(**{"num_inference": 1, "num_rollout": 1, "num_env": 2, "startup_timeout": 30,
                      "heartbeat_timeouts": {"env": 5.0}, **kw})
    s.all_up = True
    return s


def test_env_servers_are_processes_of_the_run_with_a_heartbeat_timeout():
    s = sup()
    names = [n for n, _ in s.commands("python", "/run", "tcp://c")]
    assert names == ["inference0", "learner", "env0", "env1", "rollout0"]
    argv = dict(s.commands("python", "/run", "tcp://c"))["env1"]
    assert argv[argv.index("--role") + 1] == "env" and argv[argv.index("--index") + 1] == "1"
    assert s.expected == 5 and process_role("env1") == ("env", 1) and s.process_of("env", 1) == "env1"
    s.heard(("env", 0), 0.0)
    s.heard(("rollout", 0), 0.0)
    assert s.silent(6.0) == [(("env", 0), 0.0)]  # env's own timeout (5 s), not the rollout worker's 120 s


def test_env_servers_register_with_an_address_and_lookups_wait_for_them():
    peers = Peers(num_inference=1, num_rollout=1, process_of=sup().process_of, num_env=2)
    peers.register(b"i", "inference", 0, "tcp://i", heard=set())
    peers.register(b"l", "learner", 0, "tcp://l", heard=set())
    assert peers.register(b"e", "env", 0, None, heard=set())[0] == "bad_register"
    assert peers.register(b"e", "env", 2, "tcp://e2", heard=set())[0] == "bad_register"
    peers.register(b"e0", "env", 0, "tcp://e0", heard=set())
    assert not peers.complete()
    peers.register(b"e1", "env", 1, "tcp://e1", heard=set())
    assert peers.complete()
    msg = m.Addresses(**peers.addresses)
    assert m.parse("addresses", msg.to_payload()).env == ["tcp://e0", "tcp://e1"]
    assert Peers(num_inference=1, num_rollout=1, process_of=sup().process_of).addresses.keys() == {"inference",
                                                                                                   "learner"}


def test_a_lost_env_server_is_restarted_within_its_cap_and_the_rollout_workers_are_told():
    s = sup(max_env_restarts=1)
    admission = Admission(StalenessGate(batch_size=2, policy=StalenessPolicy(1), max_concurrent=8))
    weights = WeightSync(1)
    s.heard(("env", 1), 0.0)
    p = plan_failure("env1", sup=s, admission=admission, weights=weights, registered=True, spawned=True, now=50.0)
    assert isinstance(p, EnvLost) and p.index == 1 and p.restarts == 1 and p.grants == ()
    assert p.tell == (m.WorkerLost(role="env", indices=[1]),)
    assert ("env", 1) not in s.last_seen and s.restarted_at == {"env1": 50.0} and s.env_restarts == 1
    assert s.restarts == 0  # not a rollout worker's restart
    assert p.record("died") == ("env_restart", {"reason": "died", "server": 1})
    again = plan_failure("env0", sup=s, admission=admission, weights=weights, registered=True, spawned=True, now=60.0)
    assert again == Fatal("the run already restarted 1 env servers (env.max_restarts)")
    fresh = sup()
    assert isinstance(plan_failure("env0", sup=fresh, admission=admission, weights=weights, registered=False,
                                   spawned=True, now=0.0), Fatal)


def test_a_stall_report_says_what_each_env_server_holds():
    s = sup()
    admission = Admission(StalenessGate(batch_size=2, policy=StalenessPolicy(1), max_concurrent=8))
    text = describe_stall(10.0, sup=s, admission=admission,
                          role_stats={("env", 1): {"sessions": 7, "in_flight": 3}}, last_messages={})
    assert "env1: env server 1: 7 sessions, 3 calls in flight" in text

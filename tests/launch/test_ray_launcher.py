"""`launcher=ray` on a two-node Ray cluster made on this one host (`ray.cluster_utils.Cluster`: a head with the
custom resource node_a, a second node with node_b). The default experiment runs a few steps with the inference
worker on node_a and the rollout worker and the learner on node_b; the metrics say where each role ran; the run's
end leaves no role process, actor or placement group behind. Only the Ray these tests start is stopped."""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
from typing import Optional

import pytest

from arl.config import RayConfig
from arl.launch.ray import bundle_for
from tests.e2e.test_end_to_end import MAIN, ROOT, SMALL, leftover_processes, read_metrics
from tests.waiting import wait_until


def test_bundles_carry_the_role_needs_and_its_placement() -> None:
    cfg = RayConfig(placement={"inference": {"node_a": 0.01}, "learner": [{"node_b": 0.01}, {"node_a": 0.01}]},
                    gpus_per_inference=1.0, cpus_per_rollout=2.0)
    assert bundle_for(cfg, "inference", 0, servers_per_process=2) == {"CPU": 1.0, "GPU": 2.0, "node_a": 0.01}
    assert bundle_for(cfg, "rollout", 3) == {"CPU": 2.0}
    assert bundle_for(cfg, "learner", 0) == {"CPU": 1.0, "node_b": 0.01}
    assert bundle_for(cfg, "learner", 1) == {"CPU": 1.0, "node_a": 0.01}
    assert bundle_for(cfg, "learner", 5) == {"CPU": 1.0, "node_a": 0.01}  # the last one repeats


class FakeRayLauncher:
    """Stands in for RayLauncher (no Ray needed): records whether the run released it."""

    made: list["FakeRayLauncher"] = []

    def __init__(self, *args, **kwargs) -> None:
        self.env: dict[str, str] = {}
        self.closed = False
        self.kwargs = kwargs
        FakeRayLauncher.made.append(self)

    @staticmethod
    def driver_address() -> str:
        return "127.0.0.1"

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_ray_launcher(monkeypatch):
    import arl.launch.ray as rl

    FakeRayLauncher.made = []
    monkeypatch.setattr(rl, "RayLauncher", FakeRayLauncher)
    return FakeRayLauncher.made


@pytest.mark.parametrize("fails", ["resume_state", "make_sinks", "bind"])
def test_a_run_that_fails_before_it_starts_releases_the_ray_launcher(tmp_path, monkeypatch, fake_ray_launcher,
                                                                     fails):
    """A failure between connecting to Ray and the run's try (resuming, trackers, binding) closes the launcher
    (its actors, placement groups and Ray connection)."""
    import asyncio

    from arl.config import ExperimentConfig, parse_overrides
    from arl.launch import run as local
    from arl.controller.shell import Controller, RunFailed

    cfg = parse_overrides(ExperimentConfig, ["launcher=ray", "rollout.num_workers=2"])

    def boom(*args, **kwargs):
        raise RunFailed(f"{fails} failed")

    if fails == "bind":
        monkeypatch.setattr(Controller, "bind", boom)
    else:
        monkeypatch.setattr(local, fails, boom)
    with pytest.raises(RunFailed, match=f"{fails} failed"):
        asyncio.run(local._run(cfg, str(tmp_path)))
    assert all(launcher.closed for launcher in fake_ray_launcher), fake_ray_launcher
    if fake_ray_launcher:  # the launcher is told what the run will start (checked against the cluster)
        assert fake_ray_launcher[0].kwargs["processes"] == {"inference": 1, "rollout": 2}


def test_the_run_is_checked_against_the_cluster_and_a_local_ray_fits_it() -> None:
    from arl.launch.ray import local_cpus, plain_resources, planned_bundles

    cfg = RayConfig(cpus_per_rollout=2.0, gpus_per_inference=1.0)
    plan = planned_bundles(cfg, {"inference": 2, "rollout": 3}, learner_ranks=2)
    assert [n for n, _ in plan] == ["inference0", "inference1", "learner", "learner-rank1", "rollout0", "rollout1",
                                    "rollout2"]
    assert plan[0][1] == {"CPU": 1.0, "GPU": 1.0} and plan[-1][1] == {"CPU": 2.0}
    # a Ray started for the run declares at least the CPUs its bundles need (scheduling tokens, not cores)
    assert local_cpus(cfg, plan) >= 2 + 2 + 6
    assert local_cpus(RayConfig(), planned_bundles(RayConfig(), {"inference": 1, "rollout": 1})) >= 3
    assert local_cpus(RayConfig(num_cpus=1), plan) == 1  # said explicitly: kept (and checked before placing)
    assert plain_resources({"CPU": 4.0, "CPU_group_0_abc": 1.0, "node:10.0.0.1": 1.0, "memory": 1e9,
                            "node_b": 1.0, "GPU": 1.0, "bundle_group_abc": 1000.0}) == "4 CPU, 1 GPU, 1 node_b"


def test_a_pending_placement_is_described_in_plain_words() -> None:
    from arl.launch.ray import describe_pending

    nodes = [("10.0.0.1 (abc):", {"CPU": 2.0, "node_a": 1.0, "CPU_group_x": 2.0}, {"node_a": 1.0}),
             ("10.0.0.2 (def):", {"CPU": 2.0}, None)]
    text = describe_pending("inference0", [{"CPU": 1.0}], "NO_RESOURCES", nodes)
    assert text.startswith("inference0 is waiting to be placed: it asks 1 CPU on one node; Ray says NO_RESOURCES "
                           "(no live node has that much free now); live nodes: 10.0.0.1 (abc): 2 CPU, 1 node_a "
                           "(0 CPU, 1 node_a free) | 10.0.0.2 (def): 2 CPU. "), text
    assert "Ray says SOMETHING_NEW;" in describe_pending("x", [{"CPU": 1.0}], "SOMETHING_NEW", [])


ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory) -> str:
    return os.environ.get("ARL_TEST_MODEL_CACHE") or str(tmp_path_factory.mktemp("arl-cache"))


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 1},
                                                      "include_dashboard": False})
    c.add_node(num_cpus=2, resources={"node_b": 1})
    c.wait_for_nodes()
    try:
        yield c
    finally:
        if ray.is_initialized():  # a test that failed while connected
            ray.shutdown()
        c.shutdown()  # only the Ray this module started


def run_on_ray(cluster, args: list[str], run_root: str, cache: str, timeout: float = 400):
    cmd = [sys.executable, MAIN, f"run_dir={run_root}", "run_name=run", f"model.cache_dir={cache}", "launcher=ray",
           f"ray.address={cluster.address}", *args]
    env = {k: v for k, v in os.environ.items() if k != "ARL_SECRET"}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env), \
        os.path.join(run_root, "run")


def cluster_leftovers(cluster) -> tuple[list, list]:
    """(live actors, placement groups not removed) in the test cluster, seen from a driver of our own."""
    from ray._private import state

    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        actors = [a for a in state.actors().values() if a.get("State") != "DEAD"]
        pgs = [p for p in ray.util.placement_group_table().values() if p.get("state") != "REMOVED"]
        return actors, pgs
    finally:
        ray.shutdown()


PLACE = ["ray.placement.inference={node_a: 0.01}", "ray.placement.rollout={node_b: 0.01}"]
# learner rank 0 on node_b, rank 1 on node_a; weights by broadcast (no file)
ONE_RANK = ["ray.placement.learner={node_b: 0.01}"]
TWO_RANKS = ["ray.placement.learner=[{node_b: 0.01}, {node_a: 0.01}]", "learner.num_ranks=2",
             "weights.transport=broadcast", "weights.timeout_s=60"]


@pytest.mark.slow
@pytest.mark.parametrize("extra", [ONE_RANK, TWO_RANKS], ids=["disk", "two_ranks_broadcast"])
def test_default_experiment_on_two_ray_nodes(tmp_path, model_cache, cluster, extra):
    steps = 3
    proc, run_dir = run_on_ray(cluster, [f"total_train_steps={steps}", "max_head_offpolicyness=1", *SMALL, *PLACE,
                                         *extra], str(tmp_path), model_cache)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    metrics = read_metrics(run_dir)
    train = [m for m in metrics if m["type"] == "train"]
    assert [m["step"] for m in train] == list(range(1, steps + 1))
    assert all(m["head_offpolicyness"] <= 1 and m["staleness_violations"] == 0 for m in train), train
    placed = {m["role"]: m for m in metrics if m["type"] == "role_placed"}
    assert set(placed) == {"inference0", "rollout0", "learner0"}, placed
    assert "node_a" in placed["inference0"]["node_resources"]
    assert "node_b" in placed["rollout0"]["node_resources"] and "node_b" in placed["learner0"]["node_resources"]
    assert placed["inference0"]["node_id"] != placed["rollout0"]["node_id"] == placed["learner0"]["node_id"]
    if extra is TWO_RANKS:
        ranks = placed["learner0"]["ranks"]
        assert [r["node_resources"] for r in ranks] == [["node_b"], ["node_a"]], ranks
        assert not os.path.exists(os.path.join(run_dir, "weights"))
        with open(os.path.join(run_dir, "logs", "learner-rank1.log")) as f:
            assert "learner rank 1 done after" in f.read()
    # every role's log reached the run directory on the driver, whole (its last line is the exit)
    for name in ("inference0", "rollout0", "learner"):
        with open(os.path.join(run_dir, "logs", f"{name}.log")) as f:
            text = f.read()
        assert f"starting {name if name != 'learner' else 'learner0'}" in text and "exiting with 0" in text, text[-2000:]
    # the secret went to the roles through Ray: not in config.yaml, and the controller bound off loopback
    with open(os.path.join(run_dir, "config.yaml")) as f:
        assert "secret: ''" in f.read()
    with open(os.path.join(run_dir, "addresses.json")) as f:
        assert not json.load(f)["controller"].startswith("tcp://127.")
    wait_until(lambda: leftover_processes(run_dir) == [], 30, "the roles to exit")
    wait_until(lambda: cluster_leftovers(cluster) == ([], []), 30, "no actor or placement group left")


@pytest.mark.slow
def test_a_role_that_cannot_be_placed_is_a_clear_error(tmp_path, model_cache, cluster):
    proc, run_dir = run_on_ray(cluster, ["total_train_steps=1", *SMALL, "startup_timeout=8",
                                         "ray.placement.inference={node_z: 1}"], str(tmp_path), model_cache)
    assert proc.returncode != 0
    assert "inference0 could not be placed within startup_timeout=8s" in proc.stderr, proc.stderr[-3000:]
    wait_until(lambda: leftover_processes(run_dir) == [], 30, "the roles to exit")
    wait_until(lambda: cluster_leftovers(cluster) == ([], []), 30, "no actor or placement group left")


def start_on_ray(cluster, args: list[str], run_root: str, cache: str,
                 env: Optional[dict[str, str]] = None) -> tuple[subprocess.Popen, str]:
    """`env`: more of the launcher's environment (the roles on Ray nodes see only what ray.env_vars gives them)."""
    cmd = [sys.executable, MAIN, f"run_dir={run_root}", "run_name=run", f"model.cache_dir={cache}", "launcher=ray",
           f"ray.address={cluster.address}", *args]
    env = {**{k: v for k, v in os.environ.items() if k != "ARL_SECRET"}, **(env or {})}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return proc, os.path.join(run_root, "run")


def train_records(run_dir: str) -> list[dict]:
    try:
        return [m for m in read_metrics(run_dir) if m["type"] == "train"]
    except (OSError, ValueError):
        return []


LOSE_ROLLOUT = ["ray.placement.inference={node_a: 0.01}", "ray.placement.rollout={node_c: 0.01}"]
LOSE_INFERENCE = ["inference.num_workers=2", "ray.placement.inference=[{node_a: 0.01}, {node_c: 0.01}]",
                  "ray.placement.rollout={node_b: 0.01}"]


@pytest.mark.slow
@pytest.mark.parametrize("lost", ["rollout0", "inference1"])
def test_a_lost_nodes_roles_restart_on_a_surviving_node(tmp_path, model_cache, cluster, lost):
    node_c = cluster.add_node(num_cpus=1, resources={"node_c": 1})
    cluster.wait_for_nodes()
    # the other inference server keeps the run going: enough steps left for the restarted one to come back
    # a restart (place, start, load, register) takes 15-25 s on 2 busy cores and a step 0.3-0.4 s: 40 steps left
    # only a few seconds of margin (the run ended first in the suite on 2026-11-26), 100 leave 20 s or more
    steps = 5 if lost == "rollout0" else 100
    place = LOSE_ROLLOUT if lost == "rollout0" else LOSE_INFERENCE
    proc, run_dir = start_on_ray(cluster, [f"total_train_steps={steps}", *SMALL, *ONE_RANK, *place], str(tmp_path),
                                 model_cache)
    try:
        wait_until(lambda: len(train_records(run_dir)) >= 1 or proc.poll() is not None, 300, "a first step")
        cluster.remove_node(node_c)  # takes the lost role (its actor and process) with it
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, f"exit {proc.returncode}\nstderr:\n{err[-6000:]}"
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics if m["type"] == "train"] == list(range(1, steps + 1))
    kind = "rollout_restart" if lost == "rollout0" else "inference_restart"
    restarts = [m for m in metrics if m["type"] == "worker_restarted" and m.get("kind") == kind]
    assert len(restarts) == 1, restarts
    placed = [m for m in metrics if m["type"] == "role_placed" and m["role"] == lost]
    assert [p["node_resources"] for p in placed][0] == ["node_c"]
    assert len(placed) == 2 and "node_c" not in placed[1]["node_resources"], placed
    summary = [m for m in metrics if m["type"] == "summary"][-1]
    assert summary[f"{lost[:-1]}_restarts"] == 1 and summary["learner"]["trained_twice"] == 0
    assert summary["lost_accepted_groups"] == 0 and summary["learner_balance"] == 0  # nothing accepted was lost
    if lost == "inference1":
        assert any(m["type"] == "worker_back" and m.get("server") == 1 for m in metrics)
    wait_until(lambda: leftover_processes(run_dir) == [], 30, "the roles to exit")
    wait_until(lambda: cluster_leftovers(cluster) == ([], []), 30, "no actor or placement group left")


@pytest.mark.slow
def test_a_lost_learner_node_restarts_the_learner_on_a_node_left_from_its_checkpoint(tmp_path, model_cache, cluster):
    node_c = cluster.add_node(num_cpus=1, resources={"node_c": 1})
    cluster.wait_for_nodes()
    steps = 60  # still going when the controller hears of the lost node
    place = [*PLACE, "ray.placement.learner={node_c: 0.01}", "learner.checkpoint_every=2"]
    proc, run_dir = start_on_ray(cluster, [f"total_train_steps={steps}", *SMALL, *place], str(tmp_path), model_cache)
    ckpts = os.path.join(run_dir, "checkpoints")
    try:
        wait_until(lambda: os.path.exists(os.path.join(ckpts, "latest")) or proc.poll() is not None, 300,
                   "a first checkpoint")
        cluster.remove_node(node_c)  # the learner's node: its process and its optimizer state are gone
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    # the run finished by itself: the learner came back on a node left, from its newest checkpoint
    assert proc.returncode == 0, f"exit {proc.returncode}\nstderr:\n{err[-6000:]}"
    assert "learner died" in err and "restarted from checkpoint v" in err, err[-4000:]
    metrics = read_metrics(run_dir)
    (fault,) = [m for m in metrics if m["type"] == "fault" and m.get("kind") == "learner_restart"]
    assert fault["to_version"] <= fault["from_version"] and fault["to_version"] % 2 == 0, fault
    steps_seen = [m["step"] for m in metrics if m["type"] == "train"]
    assert steps_seen[-1] == steps and sorted(set(steps_seen)) == list(range(1, steps + 1))
    placed = [m for m in metrics if m["type"] == "role_placed" and m["role"] == "learner0"]
    assert len(placed) == 2 and placed[0]["node_resources"] == ["node_c"], placed
    assert "node_c" not in placed[1]["node_resources"], placed
    summary = [m for m in metrics if m["type"] == "summary"][-1]
    assert summary["learner_restarts"] == 1 and summary["learner"]["trained_twice"] == 0
    assert summary["lost_accepted_groups"] == 0
    wait_until(lambda: leftover_processes(run_dir) == [], 30, "the roles to exit")
    wait_until(lambda: cluster_leftovers(cluster) == ([], []), 30, "no actor or placement group left")


@pytest.mark.slow
def test_ctrl_c_leaves_no_actor_or_role_process(tmp_path, model_cache, cluster):
    proc, run_dir = start_on_ray(cluster, ["total_train_steps=50", *SMALL, *PLACE, *ONE_RANK], str(tmp_path),
                                 model_cache)
    interrupt_when(proc, run_dir, cluster, lambda: len(train_records(run_dir)) >= 1, "a first step")


def interrupt_when(proc: subprocess.Popen, run_dir: str, cluster, ready, what: str) -> str:
    """Ctrl-C the run once `ready()`; it must exit with 130 and leave no process, actor or placement group.
    Returns its stderr."""
    try:
        wait_until(lambda: ready() or proc.poll() is not None, 300, what)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, f"exit {proc.returncode}\nstderr:\n{err[-4000:]}"
    wait_until(lambda: leftover_processes(run_dir) == [], 30, "the roles to exit")
    wait_until(lambda: cluster_leftovers(cluster) == ([], []), 30, "no actor or placement group left")
    return err


@pytest.mark.slow
def test_ctrl_c_while_a_role_waits_for_placement(tmp_path, model_cache, cluster):
    """inference0 starts; the learner waits for a node that does not exist: Ctrl-C ends the wait (not the 300 s
    startup_timeout) and inference0's process with it."""
    proc, run_dir = start_on_ray(cluster, ["total_train_steps=2", *SMALL, *PLACE, "startup_timeout=300",
                                           "ray.placement.learner={node_z: 1}"], str(tmp_path), model_cache)
    err = interrupt_when(proc, run_dir, cluster,
                         lambda: any(p.get("state") == "PENDING" for p in cluster_leftovers(cluster)[1]),
                         "the learner's placement group to wait")
    assert "could not be placed" not in err  # interrupted, not timed out


SLEEPER = [sys.executable, "-c", "import os, sys, time; print('hello from', os.environ.get('ARL_SECRET'), "
                                 "os.environ.get('ARL_BIND_HOST'), flush=True); time.sleep(600)"]
FAILER = [sys.executable, "-c", "print('about to fail', flush=True); raise SystemExit(3)"]


def test_ray_launcher_supervises_role_processes_on_their_nodes(tmp_path, cluster):
    """The RoleLauncher contract over Ray: placement, logs in the run directory, the environment handed through
    Ray, an unexpected exit reported with its code, kill (expected, not reported), respawn, and close."""
    from arl.launch.ray import RayLauncher

    cfg = RayConfig(address=cluster.address, placement={"inference": {"node_a": 0.01}, "rollout": {"node_b": 0.01}})
    launcher = RayLauncher(cfg, startup_timeout=60, run_dir=str(tmp_path), log_poll_s=0.1)
    launcher.env["ARL_SECRET"] = "s3cret-for-this-test"
    logs = tmp_path / "logs"
    try:
        launcher.spawn("inference0", SLEEPER, str(logs / "inference0.log"))
        launcher.spawn("rollout0", FAILER, str(logs / "rollout0.log"))
        assert launcher.where("inference0")["node_resources"] == ["node_a"]
        assert launcher.where("rollout0")["node_resources"] == ["node_b"]
        wait_until(lambda: launcher.dead() == [("rollout0", 3)], 60, "rollout0's exit to be reported")
        assert "about to fail" in (logs / "rollout0.log").read_text()
        wait_until(lambda: "hello from s3cret-for-this-test" in (logs / "inference0.log").read_text(), 60,
                   "inference0's log to reach the run directory")
        assert launcher.alive("inference0") and not launcher.alive("rollout0")
        launcher.kill("inference0")
        wait_until(lambda: not launcher.alive("inference0"), 30, "inference0 to die")
        assert launcher.dead() == [("rollout0", 3)]  # a killed role is not reported
        launcher.respawn("inference0")
        wait_until(lambda: launcher.alive("inference0") and
                   (logs / "inference0.log").read_text().count("hello from") == 2, 60, "inference0 again")
    finally:
        launcher.close()
    wait_until(lambda: cluster_leftovers(cluster) == ([], []), 30, "no actor or placement group left")


def test_a_restart_keeps_off_a_node_that_stopped_answering(tmp_path, cluster):
    """A role whose actor stopped answering (Ray's ActorUnavailableError: its node may be lost while Ray still lists
    it alive, for the tens of seconds its health checks take) restarts at once on another node, without the custom
    resource only that node has, instead of pending on the lost node's resource (issue 23 item 14). The node is not
    really lost here: the mark `_finished` sets on that error is set by hand."""
    from arl.launch.ray import RayLauncher

    cfg = RayConfig(address=cluster.address, placement={"inference": {"node_b": 0.01}})
    launcher = RayLauncher(cfg, startup_timeout=60, run_dir=str(tmp_path), log_poll_s=0.1)
    log = tmp_path / "logs" / "inference0.log"
    try:
        launcher.spawn("inference0", SLEEPER, str(log))
        first = launcher.where("inference0")
        assert first["node_resources"] == ["node_b"], first
        wait_until(lambda: "hello from" in log.read_text(), 60, "inference0's log to reach the run directory")
        launcher.kill("inference0")
        wait_until(lambda: not launcher.alive("inference0"), 30, "inference0 to die")
        launcher.roles["inference0"].hosts[0].unreachable = True
        launcher.respawn("inference0")
        wait_until(lambda: log.read_text().count("hello from") == 2, 60, "inference0 again")
        wait_until(lambda: "node_id" in launcher.where("inference0"), 30, "where inference0 runs")
        again = launcher.where("inference0")
        assert again["node_id"] != first["node_id"] and again["node_resources"] == ["node_a"], again
        assert "node_b" not in launcher.roles["inference0"].hosts[0].bundle
    finally:
        launcher.close()
    wait_until(lambda: cluster_leftovers(cluster) == ([], []), 30, "no actor or placement group left")


def test_a_restart_that_cannot_be_placed_says_why_within_seconds(tmp_path, cluster, caplog):
    """A restart whose placement group stays pending (here it asks 3 CPUs, more than either 2-CPU node has) is said
    on the console within seconds, not only as a registration timeout: the resources it asks, Ray's reason and what
    each live node has; `pending` hands the same words to the controller, which stops the run with them after
    startup_timeout (tests/controller/test_controller_faults.py)."""
    import logging

    from arl.launch.ray import RayLauncher

    cfg = RayConfig(address=cluster.address, placement={"inference": {"node_a": 0.01}})
    launcher = RayLauncher(cfg, startup_timeout=60, run_dir=str(tmp_path), log_poll_s=0.1)
    log = tmp_path / "logs" / "inference0.log"
    try:
        launcher.spawn("inference0", SLEEPER, str(log))
        assert launcher.pending("inference0") == ""
        wait_until(lambda: "hello from" in log.read_text(), 60, "inference0's log to reach the run directory")
        launcher.kill("inference0")
        wait_until(lambda: not launcher.alive("inference0"), 30, "inference0 to die")
        cfg.cpus_per_inference = 3.0  # its restart asks more than any node has
        with caplog.at_level(logging.WARNING, logger="arl.launch"):
            launcher.respawn("inference0")
            wait_until(lambda: launcher.pending("inference0"), 30, "the restart's pending reason")
        why = launcher.pending("inference0")
        assert "inference0 is waiting to be placed: it asks 3 CPU, 0.01 node_a" in why, why
        assert "Ray says INFEASIBLE" in why, why
        assert "2 CPU, 1 node_a" in why and "2 CPU, 1 node_b" in why and "free" in why and "_group_" not in why, why
        assert why in caplog.text
        assert launcher.alive("inference0") and launcher.dead() == []  # still being placed: not an exit
        launcher.kill("inference0")  # the controller gives up on it
    finally:
        launcher.close()
    wait_until(lambda: cluster_leftovers(cluster) == ([], []), 30, "no actor or placement group left")


def test_a_run_the_cluster_can_never_hold_is_refused_at_once_in_plain_words(tmp_path, cluster):
    """The cluster (two nodes of 2 CPUs) cannot hold a 3-CPU rollout worker, nor 6 CPUs in all: spawning the first
    role says so at once (which role, what it needs, what the cluster has), before any group is placed."""
    from arl.launch.ray import RayLauncher, RolePlacementError

    for cpus, rollouts, says in [(3.0, 1, "role rollout0 needs 3 CPU on one node, and no node of this Ray cluster "
                                           "has 3 CPU"),
                                 (2.0, 2, "the run's 4 role processes need 6 CPU in all (inference0 1, learner 1, "
                                          "rollout0 2, rollout1 2), and this Ray cluster has 4 CPU")]:
        cfg = RayConfig(address=cluster.address, cpus_per_rollout=cpus)
        launcher = RayLauncher(cfg, startup_timeout=5, run_dir=str(tmp_path), processes={"inference": 1,
                                                                                         "rollout": rollouts})
        try:
            with pytest.raises(RolePlacementError) as e:
                launcher.spawn("inference0", SLEEPER, str(tmp_path / "logs" / "inference0.log"))
            assert says in str(e.value), str(e.value)
            assert "(its nodes: 2 CPU, 1 node_a | 2 CPU, 1 node_b)" in str(e.value) and "_group_" not in str(e.value), str(e.value)
            assert "scheduling tokens" in str(e.value)
            assert not launcher.roles
        finally:
            launcher.close()
    wait_until(lambda: cluster_leftovers(cluster) == ([], []), 30, "no actor or placement group left")


def test_dead_and_respawn_never_wait_on_ray_in_the_callers_thread(tmp_path, cluster, monkeypatch):
    """`dead` and `respawn` run on the controller's event loop: no `ray.get` there may wait for an answer (a log
    copy, an actor's end); they are the log thread's and the restart thread's. And a role that wrote more than
    FINAL_LOG_MAX after the last copy keeps its last lines (its end), not its first ones."""
    import threading

    import arl.launch.ray as rl

    caller = threading.current_thread()
    waited: list[str] = []
    real_get = ray.get

    def get(refs, *args, **kwargs):
        if threading.current_thread() is caller:
            listed = refs if isinstance(refs, list) else [refs]
            ready, _ = ray.wait(listed, num_returns=len(listed), timeout=0)
            if len(ready) < len(listed):
                waited.append("".join(__import__("traceback").format_stack(limit=6)))
        return real_get(refs, *args, **kwargs)

    cfg = RayConfig(address=cluster.address, placement={"rollout": {"node_b": 0.01}})
    launcher = rl.RayLauncher(cfg, startup_timeout=60, run_dir=str(tmp_path), log_poll_s=0.2)
    logs = tmp_path / "logs"
    big = (64 + 24) << 20  # more than the 64 MiB a final copy takes, written at once (far ahead of the copies)
    writer = [sys.executable, "-c", f"import sys; sys.stdout.write('first line\\n' + 'x' * {big} + '\\nTHE END\\n');"
                                    "sys.stdout.flush(); raise SystemExit(5)"]
    try:
        launcher.spawn("rollout0", writer, str(logs / "rollout0.log"))
        monkeypatch.setattr(ray, "get", get)
        wait_until(lambda: launcher.dead() == [("rollout0", 5)], 120, "rollout0's exit to be reported")
        size = (logs / "rollout0.log").stat().st_size
        with open(logs / "rollout0.log", "rb") as f:
            f.seek(size - 100)
            assert f.read().endswith(b"\nTHE END\n")  # the crash tail is there
        assert size <= big + 4096, size
        launcher.respawn("rollout0")  # copies, ends the old actor and places the new one in a thread
        wait_until(lambda: launcher.dead() == [("rollout0", 5)] and
                   (logs / "rollout0.log").read_bytes().count(b"THE END") == 2, 120, "the restarted rollout0")
        monkeypatch.setattr(ray, "get", real_get)
        assert waited == [], waited[0]
    finally:
        monkeypatch.setattr(ray, "get", real_get)
        launcher.close()
    wait_until(lambda: cluster_leftovers(cluster) == ([], []), 30, "no actor or placement group left")


def groups_on(cluster, node_id: str) -> list:
    """Placement groups not removed that have a bundle on node `node_id`."""
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        return [p for p in ray.util.placement_group_table().values()
                if p.get("state") != "REMOVED" and node_id in (p.get("bundles_to_node_id") or {}).values()]
    finally:
        ray.shutdown()


def scale(run_dir: str, *changes: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "arl.ctl", run_dir, "scale", *changes], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


PACE_MODULE = '''
"""The math single-step agent, except that a group with tokens of policy version >= the number in the file
$ARL_TEST_CEILING waits until that number is higher or the file is gone: the test keeps the run from ending before
it has made its changes, on a machine of any speed."""
import asyncio
import os

from arl.agents.math_single_step import MathSingleStepAgent
from arl.api import register_agent

CEILING = os.environ["ARL_TEST_CEILING"]


def ceiling():
    try:
        with open(CEILING) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


class PacedAgent(MathSingleStepAgent):
    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        trajs = await super().collect_trajectory(prompt, env, obs_queue, act_queue)
        newest = max((int(t.versions.max()) for t in trajs if len(t.versions)), default=-1)
        while (c := ceiling()) is not None and newest >= c:
            await asyncio.sleep(0.1)
        return trajs


register_agent("paced-math", PacedAgent)
'''


class Pace:
    """A ceiling on the run's policy version that the test raises as it goes (`allow`) and takes away (`end`); it
    reaches the role processes on every Ray node through `ray.env_vars`."""

    def __init__(self, tmp_dir: str, ceiling: int) -> None:
        self.dir = os.path.join(tmp_dir, "pace")
        os.makedirs(self.dir, exist_ok=True)
        with open(os.path.join(self.dir, "paced_agent.py"), "w") as f:
            f.write(PACE_MODULE)
        self.file = os.path.join(self.dir, "ceiling")
        self.allow(ceiling)
        path = os.pathsep.join([self.dir, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self.env = {"ARL_TEST_CEILING": self.file, "PYTHONPATH": path}  # the launcher's (it imports the module too)
        # a run held at its ceiling is stalled on purpose: not the stall rule's case
        self.args = ["imports=[paced_agent]", "agent.name=paced-math", "rollout.max_no_progress_s=3600",
                     f"ray.env_vars={{ARL_TEST_CEILING: '{self.file}', PYTHONPATH: '{path}'}}"]

    def allow(self, ceiling: int) -> None:
        with open(self.file + ".tmp", "w") as f:
            f.write(str(ceiling))
        os.replace(self.file + ".tmp", self.file)

    def end(self) -> None:
        os.unlink(self.file)


@pytest.mark.slow
def test_servers_and_rollout_workers_join_and_leave_on_ray(tmp_path, model_cache, cluster):
    """`arl.ctl scale` on Ray: +2 / -1 / +1 inference servers and +1 / -1 rollout workers, placed by Ray on a node
    that joined the cluster; the run finishes with nothing accepted lost, and once its servers there are scaled
    out too, their placement groups are given back and the node leaves without costing the run a role. The role
    processes get the test's paced agent through ray.env_vars: the run's version stays under a ceiling the test
    raises step by step, so it cannot end before the last change, however fast the machine."""
    node_c = cluster.add_node(num_cpus=3, resources={"node_c": 1})
    cluster.wait_for_nodes()
    place = ["ray.placement.inference=[{node_a: 0.01}, {node_c: 0.01}]",  # servers 1, 2, 3: node_c (last repeats)
             "ray.placement.rollout=[{node_b: 0.01}, {node_c: 0.01}]",
             "eval.every_n_steps=5"]  # the eval records carry rollout0's client counts: which servers it sent to
    steps = 200
    pace = Pace(str(tmp_path), ceiling=10)
    proc, run_dir = start_on_ray(cluster, [f"total_train_steps={steps}", *SMALL, *ONE_RANK, *place, *pace.args],
                                 str(tmp_path), model_cache, env=pace.env)

    def placed() -> dict:
        return {m["role"]: m for m in read_metrics(run_dir) if m["type"] == "role_placed"}

    def joined() -> set:
        return {m["server"] for m in read_metrics(run_dir) if m["type"] == "worker_back"}

    def ok(*changes: str) -> str:
        done = scale(run_dir, *changes)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    def sent_to(server: int) -> int:
        """Requests rollout0 sent to `server` so far, as of the newest evaluation."""
        evals = [m for m in read_metrics(run_dir) if m["type"] == "eval"]
        return evals[-1].get("roles", {}).get("rollout0", {}).get("client", {}).get(f"sent_w{server}", 0) \
            if evals else 0

    def advance(n: int, servers: set, what: str) -> None:
        """Let the run train at least `n` more steps and until rollout0 has sent to each of `servers` (routing
        picks a new server when it is the least loaded, which can take a while at this load), a few versions
        past where it is at each look."""
        at = len(train_records(run_dir))

        def done() -> bool:
            pace.allow(len(train_records(run_dir)) + 4)
            return len(train_records(run_dir)) >= at + n and all(sent_to(w) for w in servers) or \
                proc.poll() is not None

        wait_until(done, 300, what)

    try:
        wait_until(lambda: len(train_records(run_dir)) >= 1 or proc.poll() is not None, 300, "a first step")
        out = ok("inference=+2", "rollout=+1")
        assert "started servers [1, 2]" in out and "started rollout workers [1]" in out, out
        wait_until(lambda: "rollout1" in placed() and joined() >= {1, 2} or proc.poll() is not None, 300,
                   "servers 1, 2 and rollout1 to join")
        advance(10, {1, 2}, "ten steps, with requests of rollout0 on servers 1 and 2")
        pace.allow(len(train_records(run_dir)) + 30)  # rollout1's groups must not be held while it drains
        out = ok("inference=-1", "rollout=-1")
        assert "drained and stopped servers [2]" in out and "drained and stopped rollout workers [1]" in out, out
        assert "streams [1] to rollout0" in out and int(re.search(r"accepted there: \{1: (\d+)\}", out)[1]) > 0, out
        assert "started servers [3]" in ok("inference=+1")
        wait_until(lambda: 3 in joined() or proc.poll() is not None, 300, "server 3 to join")
        advance(5, {3}, "five steps, with requests of rollout0 on server 3")
        assert proc.poll() is None and len(train_records(run_dir)) < steps  # the pace works: the run is still on
        assert "drained and stopped servers [1, 3]" in ok("inference=-2")  # nothing of the run left on node_c
        wait_until(lambda: not groups_on(cluster, node_c.node_id), 30, "node_c's placement groups to go")
        cluster.remove_node(node_c)  # given back
        pace.end()
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, f"exit {proc.returncode}\nstderr:\n{err[-6000:]}"
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics if m["type"] == "train"] == list(range(1, steps + 1))
    where = placed()
    for role in ("inference1", "inference2", "inference3", "rollout1"):
        assert where[role]["node_resources"] == ["node_c"], where
    published = 0  # every server joined with the newest weights
    for m in metrics:
        if m["type"] == "train":
            published = max(published, m["version"])
        elif m["type"] == "worker_back":
            assert m["version"] >= published, (m, published)
    summary = [m for m in metrics if m["type"] == "summary"][-1]
    assert summary["lost_accepted_groups"] == 0 and summary["learner_balance"] == 0
    assert summary["rollout_restarts"] == summary["inference_restarts"] == 0
    assert not [m for m in metrics if m["type"] in ("worker_restarted", "fault")]
    client = [m for m in metrics if m["type"] == "eval"][-1]["roles"]["rollout0"]["client"]
    assert client["sent_w1"] > 0 and client["sent_w2"] > 0 and client["sent_w3"] > 0, client
    wait_until(lambda: leftover_processes(run_dir) == [], 30, "the roles to exit")
    wait_until(lambda: cluster_leftovers(cluster) == ([], []), 30, "no actor or placement group left")

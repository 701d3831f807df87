"""launcher=ray on real `ray start` nodes started as README's cluster section says (tests/launch/ray_nodes.py):
token authentication on, each node with a HOME of its own, all on this host with ports picked free. A machine
without the head's token is refused; with it, the cluster forms; a run whose only inference server is on a node
that dies (its processes SIGKILLed, raylet included) restarts that server on a node that is left and finishes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.e2e.test_end_to_end import MAIN, ROOT, SMALL, leftover_processes, read_metrics
from tests.launch.ray_nodes import RayNodes
from tests.waiting import wait_until

ray = pytest.importorskip("ray")

# starting three Ray nodes and a run on them, on 2 shared cores, takes minutes
pytestmark = pytest.mark.timeout(1800)

README = os.path.join(ROOT, "README.md")


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    c = RayNodes(str(tmp_path_factory.mktemp("ray-nodes")))
    try:
        c.start_head('{"node_a": 1}')
        c.add_node("b", '{"node_b": 1}')
        c.wait_nodes(2)
        yield c
    finally:
        c.shutdown()  # only the nodes started here


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory) -> str:
    return os.environ.get("ARL_TEST_MODEL_CACHE") or str(tmp_path_factory.mktemp("arl-cache"))


@pytest.mark.slow
def test_readme_cluster_commands_make_a_cluster_with_token_authentication(nodes):
    with open(README) as f:
        readme = f.read()
    for command in ("export RAY_AUTH_MODE=token", "ray get-auth-token --generate",
                    "export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=<the token the head printed>",
                    "ray start --head --port=6379 --resources='{\"node_a\": 1}'",
                    "ray start --address=HEAD_IP:6379 --resources='{\"node_b\": 1}'"):
        assert command in readme, command  # what the fixture ran
    # a machine that lacks the head's token cannot join
    tokenless = nodes.add_node("tokenless", '{"node_x": 1}', token="")
    nodes.retry.pop("tokenless")  # its exit is the point: not started again
    assert tokenless.wait(timeout=300) != 0
    assert "no authentication token was found" in nodes.output("tokenless"), nodes.output("tokenless")[-3000:]
    # with it the cluster has both nodes, and `ray status` (with the token) says so
    assert nodes.alive_nodes() == 2, nodes.status().stdout


def driver_env(nodes: RayNodes) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k != "ARL_SECRET"}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=nodes.token)
    return env


def train_steps(run_dir: str) -> list[int]:
    try:
        return [m["step"] for m in read_metrics(run_dir) if m["type"] == "train"]
    except (OSError, ValueError):
        return []


@pytest.mark.slow
def test_a_lost_node_with_the_only_inference_server_restarts_it_on_a_node_left(tmp_path, nodes, model_cache):
    nodes.add_node("c", '{"node_c": 1}')
    nodes.wait_nodes(3)
    steps = 30  # groups already made may carry a few steps past the kill: the run must still be going when the
    # controller hears of the lost node (without an inference server no step happens until it is back)
    run_dir = os.path.join(str(tmp_path), "run")
    cmd = [sys.executable, MAIN, f"run_dir={tmp_path}", "run_name=run", f"model.cache_dir={model_cache}",
           "launcher=ray", f"ray.address={nodes.address}", f"total_train_steps={steps}", *SMALL,
           "startup_timeout=600",  # three Ray nodes and the roles on 2 shared cores: starting is slow
           "ray.placement.inference={node_c: 0.01}", "ray.placement.rollout={node_a: 0.01}",
           "ray.placement.learner={node_b: 0.01}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=driver_env(nodes))
    try:
        wait_until(lambda: len(train_steps(run_dir)) >= 1 or proc.poll() is not None, 600, "a first step")
        nodes.kill_node("c")  # the machine with the only inference server goes away
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, f"exit {proc.returncode}\nstderr:\n{err[-6000:]}"
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics if m["type"] == "train"] == list(range(1, steps + 1))
    restarts = [m for m in metrics if m["type"] == "worker_restarted" and m.get("kind") == "inference_restart"]
    assert len(restarts) == 1, restarts
    placed = [m for m in metrics if m["type"] == "role_placed" and m["role"] == "inference0"]
    assert len(placed) == 2 and placed[0]["node_resources"] == ["node_c"], placed
    assert "node_c" not in placed[1]["node_resources"] and placed[1]["node_resources"], placed
    assert any(m["type"] == "worker_back" and m.get("server") == 0 for m in metrics)
    summary = [m for m in metrics if m["type"] == "summary"][-1]
    assert summary["inference_restarts"] == 1 and summary["learner"]["trained_twice"] == 0
    assert summary["lost_accepted_groups"] == 0 and summary["learner_balance"] == 0
    # the console shows the lost process's last log lines, as its message says
    said, _, shown = err.partition("inference process inference0 exited with code None")
    assert shown, err[-6000:]
    lines = shown.partition("last lines of its log:\n")[2].splitlines()
    with open(os.path.join(run_dir, "logs", "inference0.log")) as f:
        log = f.read()
    assert lines and lines[0].strip() and lines[0] in log, shown[:3000]
    wait_until(lambda: leftover_processes(run_dir) == [], 60, "the roles to exit")

"""Env servers under `launcher=ray`: their bundles (ray.cpus_per_env, ray.placement.env) and a two-server run on
the two-node local cluster with the env servers placed on node_a and the rollout worker on node_b (the env calls
cross nodes, signed)."""

from __future__ import annotations

import pytest

from arl.config import RayConfig
from arl.launch.ray import bundle_for, planned_bundles
from tests.e2e.test_end_to_end import SMALL, read_metrics
from tests.launch.test_ray_launcher import PLACE, cluster, cluster_leftovers, model_cache, run_on_ray  # noqa: F401
from tests.waiting import wait_until


def test_env_servers_get_bundles_of_their_own():
    cfg = RayConfig(placement={"env": {"cpu_node": 0.01}}, cpus_per_env=0.5)
    assert bundle_for(cfg, "env", 1) == {"CPU": 0.5, "cpu_node": 0.01}
    names = [n for n, _ in planned_bundles(cfg, {"inference": 1, "rollout": 1, "env": 2})]
    assert names == ["inference0", "learner", "rollout0", "env0", "env1"]


@pytest.mark.slow
def test_two_env_servers_on_another_ray_node(tmp_path, model_cache, cluster):  # noqa: F811
    steps = 3
    proc, run_dir = run_on_ray(cluster, [f"total_train_steps={steps}", "env.servers=2", *SMALL, *PLACE,
                                         "ray.placement.learner={node_b: 0.01}", "ray.placement.env={node_a: 0.01}",
                                         "ray.cpus_per_env=0.25"], str(tmp_path), model_cache)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstderr:\n{proc.stderr[-6000:]}"
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics if m["type"] == "train"] == list(range(1, steps + 1))
    placed = {m["role"]: m for m in metrics if m["type"] == "role_placed"}
    assert {"env0", "env1"} <= set(placed), placed
    assert all("node_a" in placed[e]["node_resources"] for e in ("env0", "env1"))
    assert placed["env0"]["node_id"] != placed["rollout0"]["node_id"]
    (s,) = [m for m in metrics if m["type"] == "summary"]
    assert set(s["env_servers"]) == {"env0", "env1"} and s["lost_accepted_groups"] == 0
    wait_until(lambda: cluster_leftovers(cluster) == ([], []), 30, "no actor or placement group left")

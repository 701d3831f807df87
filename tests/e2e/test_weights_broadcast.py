"""`weights.transport=broadcast` end to end: the real launcher, every role a process, weights sent by the learner's
rank 0 over a torch.distributed group per inference worker; no weight file anywhere in the run directory, and a
restarted inference worker gets the newest weights through a group of its own."""

from __future__ import annotations

import os
import signal
import sys

import pytest

from tests.e2e.test_end_to_end import SMALL, assert_clean_run, read_metrics, run_main
from tests.faults.harness import Hold, finish, role_pids, start_run, summary, train_steps, wait_for

BROADCAST = ["weights.transport=broadcast", "weights.timeout_s=60"]


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory) -> str:
    """$ARL_TEST_MODEL_CACHE if set (reuse a warm-up), else one warm-up for this module."""
    return os.environ.get("ARL_TEST_MODEL_CACHE") or str(tmp_path_factory.mktemp("arl-cache"))


def weight_files(run_dir: str) -> list[str]:
    """Every file under the run directory that holds weights for inference (the learner's checkpoints and the
    final export are not inference weights)."""
    out = []
    for root, _dirs, files in os.walk(run_dir):
        rel = os.path.relpath(root, run_dir)
        if rel.split(os.sep)[0] in ("checkpoints", "final"):
            continue
        out += [os.path.join(rel, f) for f in files if f.endswith((".safetensors", ".bin", ".pt"))]
    return out


def loaded_versions(run_dir: str, role: str) -> list[int]:
    """The versions an inference worker loaded, in order, from its log."""
    out = []
    with open(os.path.join(run_dir, "logs", f"{role}.log")) as f:
        for line in f:
            if "loaded weights v" in line and "the learner's broadcast" in line:
                out.append(int(line.split("loaded weights v")[1].split()[0]))
    return out


@pytest.mark.slow
def test_torch_engine_trains_with_broadcast_weights_and_no_weight_file(tmp_path, model_cache):
    steps, eta = 3, 1
    proc, run_dir = run_main([f"total_train_steps={steps}", f"max_head_offpolicyness={eta}", *BROADCAST, *SMALL],
                             str(tmp_path), model_cache)
    train = assert_clean_run(proc, run_dir, steps)
    for m in train:
        assert m["head_offpolicyness"] <= eta and m["staleness_violations"] == 0, m
    versions = loaded_versions(run_dir, "inference0")
    assert versions and versions == sorted(set(versions)) and versions[-1] == steps, versions
    assert weight_files(run_dir) == []
    assert not os.path.exists(os.path.join(run_dir, "weights"))
    assert os.path.exists(os.path.join(run_dir, "final", "model.safetensors"))  # the run's product still is
    with open(os.path.join(run_dir, "logs", "learner.log")) as f:
        assert "sent weights v" in f.read()
    evals = [m for m in read_metrics(run_dir) if m["type"] == "eval"]
    assert evals[-1]["roles"]["learner0"]["weight_send_failures"] == 0
    # the delivery itself is proven above (the worker loaded every version, the learner logged its sends); the
    # counters come from the learner's last heartbeat, which can predate its first send in a 3-step run
    assert "weight_sends" in evals[-1]["roles"]["learner0"]


FAKE_SGLANG = f"""#!/bin/sh
exec {sys.executable} -m tests.inference.fake_sglang "$@"
"""


@pytest.mark.slow
def test_sglang_engine_gets_broadcast_weights_through_its_endpoints(tmp_path, model_cache):
    """The sglang backend with the fake server (SGLang 0.5.23's schema and its gloo receive): the server joins the
    learner's group through /init_weights_update_group and loads each version through
    /update_weights_from_distributed; no weight directory is built for it."""
    fake = tmp_path / "fake_python"
    fake.write_text(FAKE_SGLANG)
    fake.chmod(0o755)
    steps = 2
    proc, run_dir = run_main(["inference.backend=sglang", f"inference.sglang.python={fake}",
                              "inference.sglang.startup_timeout=120", f"total_train_steps={steps}",
                              "max_head_offpolicyness=1", "rollout.verify_token_ledger=false",
                              "agent.name=math-single-step", "agent.args={filter_uniform_groups: false}", *BROADCAST,
                              *[a for a in SMALL if "verify_token_ledger" not in a]], str(tmp_path), model_cache)
    assert_clean_run(proc, run_dir, steps)
    versions = loaded_versions(run_dir, "inference0")
    assert versions and versions[-1] == steps, versions
    assert weight_files(run_dir) == [] and not os.path.exists(os.path.join(run_dir, "sglang-weights"))
    with open(os.path.join(run_dir, "logs", "inference0.log")) as f:
        log = f.read()
    assert "joined weight group" in log and "broadcast group" in log


@pytest.mark.slow
def test_restarted_inference_worker_gets_the_newest_weights_by_broadcast(tmp_path, model_cache):
    steps = 4
    hold = Hold(str(tmp_path), hold_from=2)  # the run waits at step 2 until the restarted worker is back
    proc, run_dir = start_run(str(tmp_path), model_cache, ["inference.num_workers=2", f"total_train_steps={steps}",
                                                           *BROADCAST, *hold.args], env=hold.env)
    wait_for(lambda: len(train_steps(run_dir)) >= 1, proc, what="the first step")
    old = role_pids(run_dir)["inference1"]
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: any(m.get("type") == "worker_back" for m in read_metrics(run_dir)), proc, timeout=300,
             what="the restarted inference worker to rejoin")
    hold.release()
    code, _, err = finish(proc)
    assert code == 0, err[-6000:]
    assert train_steps(run_dir) == list(range(1, steps + 1))
    assert summary(run_dir)["inference_restarts"] == 1
    # the new incarnation caught up by broadcast (a group of its own) before it rejoined: its first load is the
    # newest version published by then, at least 1
    with open(os.path.join(run_dir, "logs", "inference1.log")) as f:
        log = f.read()
    groups = sorted({line.split("joined weight group ")[1].split()[0] for line in log.splitlines()
                     if "joined weight group" in line})
    assert len(groups) == 2, groups  # one per incarnation (the log is appended to)
    assert loaded_versions(run_dir, "inference1")[-1] == steps
    assert weight_files(run_dir) == []

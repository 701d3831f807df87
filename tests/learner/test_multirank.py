"""Two learner ranks over gloo on CPU (torchrun): each rank trains on its share of every batch (whole groups);
both end with the same weights, equal to one rank training on the whole batches."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("deepspeed")

from safetensors.torch import load_file  # noqa: E402

from arl.utils.net import free_port  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def run_two_ranks_and_one(tmp_path, common: list) -> tuple:
    """`_train_fixed.py` with ``common`` on two gloo ranks (torchrun) and on one; returns the two-rank process and
    both output prefixes (``<out>.rank<r>``, ``<out>.full``)."""
    script = os.path.join(HERE, "_train_fixed.py")
    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    r2 = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
                         "127.0.0.1", "--master_port", str(free_port()), script, "--out", two, *common],
                        capture_output=True, text=True, timeout=400, env=_env())
    assert r2.returncode == 0, r2.stdout[-3000:] + r2.stderr[-3000:]
    r1 = subprocess.run([sys.executable, script, "--out", one, *common], capture_output=True, text=True,
                        timeout=400, env=_env())
    assert r1.returncode == 0, r1.stdout[-3000:] + r1.stderr[-3000:]
    return r2, two, one


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 2])
def test_two_gloo_ranks_equal_weights_and_match_one_rank(tmp_path, zero_stage):
    r2, two, one = run_two_ranks_and_one(tmp_path, ["--steps", "3", "--ranks", "--zero-stage", str(zero_stage)])
    # both ranks trained 3 steps on 12 sequences per step (6 each)
    for rank in (0, 1):
        assert f"rank {rank} step 3:" in r2.stdout
    w0, w1 = load_file(f"{two}.rank0"), load_file(f"{two}.rank1")
    ref = load_file(f"{one}.rank0")
    full = load_file(f"{two}.full")
    for k in ref:
        assert torch.equal(w0[k], w1[k]), k  # the ranks agree exactly
        torch.testing.assert_close(w0[k], ref[k], rtol=1e-5, atol=1e-6)  # and match one rank up to float order
        assert torch.equal(full[k], w0[k]), k
    assert all(torch.equal(ref[k], v) for k, v in load_file(f"{one}.full").items())

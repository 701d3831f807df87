"""End-to-end: a run of the real launcher records its batches; scripts/replay.py reproduces a checkpoint from its
predecessor bit for bit and re-scores a traced trajectory under the weights that generated it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("deepspeed")

from arl.learner.record import batch_path, read_batch, read_manifest, recorded_versions  # noqa: E402
from arl.report.traces import read_jsonl  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAIN = os.path.join(ROOT, "training", "main_async_ppo.py")
REPLAY = os.path.join(ROOT, "scripts", "replay.py")
STEPS = 3
ARGS = ["learner.batch_size=2", "agent.group_size=4", "rollout.max_concurrent_rollouts=8", "eval.every_n_steps=0",
        "eval.max_prompts=8", "progress=false", "startup_timeout=240", f"total_train_steps={STEPS}",
        "model.warmup_max_steps=5",  # any model will do: keep the (uncached) warm-up short
        "rollout.filter_uniform_groups=false", "agent.args.filter_uniform_groups=false",  # a weak model's groups train
        "learner.record_batches=true", "learner.checkpoint_every=1", f"learner.keep_checkpoints={STEPS}",
        "rollout.trace_rate=1.0"]


def _replay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, REPLAY, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_replay_a_recorded_run(tmp_path):
    root = str(tmp_path / "runs")
    run = os.path.join(root, "run")
    proc = subprocess.run([sys.executable, MAIN, f"run_dir={root}", "run_name=run",
                           f"model.cache_dir={tmp_path / 'cache'}", *ARGS], cwd=ROOT, capture_output=True, text=True,
                          timeout=500)
    assert proc.returncode == 0, proc.stderr[-4000:]
    batches = os.path.join(run, "batches")
    assert recorded_versions(batches) == list(range(1, STEPS + 1))
    assert read_manifest(batches)["threads"] >= 1
    sizes = [os.path.getsize(batch_path(batches, v)) for v in range(1, STEPS + 1)]
    tokens = [sum(len(t.input_ids) for t in read_batch(batch_path(batches, v)).trajs) for v in range(1, STEPS + 1)]
    print(f"recorded batches: {sizes} bytes for {tokens} tokens per step")

    r = _replay(run, "--from", "v1", "--to", "v2")
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "replay v1 -> v2: bit-exact" in r.stdout

    # a traced trajectory that was trained: re-scored under the versions that generated its tokens
    trained = {t.group_id for v in range(1, STEPS + 1) for t in read_batch(batch_path(batches, v)).trajs}
    traced = [t for t in read_jsonl(os.path.join(run, "traces.jsonl")) if t["group"] in trained]
    assert traced, "no traced trajectory was trained"
    traced.sort(key=lambda t: -max(t["versions"] or [0]))  # the newest policy's, where any is past v0
    r = _replay(run, "--trajectory", f"{traced[0]['group']}#0")  # rollout group ids hold a '#' themselves
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    print(r.stdout)
    m = re.search(r"(\d+) tokens, \|engine - learner\| logprob max (\S+), mean (\S+)", r.stdout)
    assert m and int(m.group(1)) > 0, r.stdout
    # the torch inference engine and the learner run the same weights in fp32: equal up to float rounding
    assert float(m.group(2)) < 1e-3, r.stdout

    r = _replay(run, "--from", "v0", "--to", "v1")  # the learner checkpoints after steps, never v0
    assert r.returncode == 2 and "error: checkpoint v0 (--from) is not in" in r.stderr, r.stderr

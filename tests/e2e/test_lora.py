"""`learner.lora` end to end: the real launcher, every role a process. Each version travels as an adapter payload
(megabytes less than the model), `final/` is the adapter as a peft folder (+ `final/merged/`), `scripts/evaluate.py`
loads either and scores what the run's last evaluation printed; the broadcast transport carries adapters too; the
default experiment learns with rank 8."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.test_end_to_end import ROOT, SMALL, assert_clean_run, model_cache, read_metrics, run_main  # noqa: F401
from tests.e2e.test_weights_broadcast import BROADCAST, loaded_versions, weight_files

pytest.importorskip("peft")

EVALUATE = os.path.join(ROOT, "scripts", "evaluate.py")
LORA = ["learner.lora.rank=8"]


def evaluate(*args: str) -> dict:
    out = subprocess.run([sys.executable, EVALUATE, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_lora_adapters_travel_by_broadcast(tmp_path, model_cache):
    steps = 3
    proc, run_dir = run_main(SMALL + LORA + BROADCAST + [f"total_train_steps={steps}", "max_head_offpolicyness=1"],
                             str(tmp_path), model_cache)
    assert_clean_run(proc, run_dir, steps)
    versions = loaded_versions(run_dir, "inference0")
    assert versions and versions == sorted(set(versions)) and versions[-1] == steps, versions
    assert weight_files(run_dir) == []
    assert os.path.isfile(os.path.join(run_dir, "final", "adapter_model.safetensors"))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_default_experiment_with_lora_rank_8_learns_and_ships_a_peft_folder_and_a_merged_model(tmp_path, model_cache):
    """The bar of issue 27: >= +15 points of greedy accuracy with rank-8 adapters: the default experiment, 100 steps
    (the learning rate decays over them; docs/benchmarks.md has the figures and the full fine-tuning beside them).
    Not timed here (a shared machine); the run's duration is in its metrics. The same run's published versions are
    adapter payloads, and its `final/` a peft folder (+ `final/merged/`) that scores what the run printed."""
    steps = 100
    proc, run_dir = run_main(LORA + [f"total_train_steps={steps}", "progress=false", "startup_timeout=240",
                                     "export.merge_lora=true"], str(tmp_path), model_cache, timeout=1700)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = [m for m in read_metrics(run_dir) if m["type"] == "eval"]
    assert evals[0]["version"] == 0 and evals[-1]["version"] == steps
    assert evals[-1]["first_acc"] >= evals[0]["first_acc"] + 0.15, [(m["version"], m["first_acc"]) for m in evals]
    assert_ships_adapters(run_dir, steps, evals[-1])


def assert_ships_adapters(run_dir: str, steps: int, last: dict) -> None:
    """Version `steps` was published as an adapter payload (far smaller than the model); `final/` is a peft folder
    whose merge equals `final/merged/`, which moved from the base; scripts/evaluate.py on either and on the run
    directory scores what the run's last evaluation (`last`) printed."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from arl.weights.adapter import is_adapter

    cfg = json.load(open(os.path.join(run_dir, "final", "adapter_config.json")))
    base_dir = cfg["base_model_name_or_path"]
    published = load_file(os.path.join(run_dir, "weights", f"v{steps}.safetensors"))
    assert is_adapter(published)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    full_bytes = sum(v.numel() * v.element_size() for v in base.state_dict().values())
    assert sum(v.numel() * v.element_size() for v in published.values()) * 5 < full_bytes
    # the peft folder loads with peft and gives the merged model's weights
    merged_by_peft = PeftModel.from_pretrained(base, os.path.join(run_dir, "final")).merge_and_unload()
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "final", "merged"))
    for k, v in merged.state_dict().items():
        torch.testing.assert_close(merged_by_peft.state_dict()[k], v)
    assert any(not torch.equal(v, AutoModelForCausalLM.from_pretrained(base_dir).state_dict()[k])
               for k, v in merged.state_dict().items())  # it moved
    # evaluate.py loads the adapter folder, the merged model and the run directory: the run's own figures
    for target in (os.path.join(run_dir, "final"), os.path.join(run_dir, "final", "merged"), run_dir):
        result = evaluate(target)
        for key in ("n", "first_acc", "solved_acc", "mean_turns"):
            assert result[key] == last[key], (target, key, result[key], last[key])
        assert result["version"] == steps

"""The run ships its model: `<run>/final/` after the default experiment, loaded with transformers as it is, and
`scripts/evaluate.py` on it (and on the run's last checkpoint) scoring what the run's last evaluation printed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.test_end_to_end import ROOT, SMALL, assert_clean_run, model_cache, read_metrics, run_main  # noqa: F401

EVALUATE = os.path.join(ROOT, "scripts", "evaluate.py")
STEPS = 2


def evaluate(*args: str) -> tuple[str, dict]:
    out = subprocess.run([sys.executable, EVALUATE, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout, json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_final_folder_and_evaluate_match_the_run(tmp_path, model_cache):
    proc, run_dir = run_main(SMALL + [f"total_train_steps={STEPS}", "eval.every_n_steps=0"], str(tmp_path),
                             model_cache)
    assert_clean_run(proc, run_dir, STEPS)
    last = [m for m in read_metrics(run_dir) if m["type"] == "eval"][-1]
    assert last["version"] == STEPS

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

    final = os.path.join(run_dir, "final")
    model = AutoModelForCausalLM.from_pretrained(final)
    weights = load_file(os.path.join(run_dir, "weights", f"v{STEPS}.safetensors"))
    sd = model.state_dict()
    assert all(sd[k].equal(v) for k, v in weights.items())  # the weights the last step published
    auto, fast = AutoTokenizer.from_pretrained(final), PreTrainedTokenizerFast.from_pretrained(final)
    chat = [{"role": "user", "content": "12+7="}]
    assert auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == "<|user|>12+7=<|assistant|>"
    assert auto.encode("1 + 2 = 3", add_special_tokens=False) == fast.encode("1 + 2 = 3", add_special_tokens=False)
    gen = GenerationConfig.from_pretrained(final)
    assert gen.eos_token_id == fast.eos_token_id and gen.temperature == 1.0 and gen.max_new_tokens == 8
    with open(os.path.join(final, "arl_export.json")) as f:
        assert json.load(f)["version"] == STEPS

    # greedy evaluation, same code and config as the run's: the same figures (the held-out prompts, the turns and
    # token counts of every trajectory summed up in traj_means, the accuracies)
    text, result = evaluate(final)
    assert f"eval v{STEPS}: first-answer acc {last['first_acc']:.3f}, solved within all turns " \
           f"{last['solved_acc']:.3f} ({last['n']} prompts" in text
    for key in ("n", "first_acc", "solved_acc", "mean_turns", "traj_means", "errors"):
        assert result[key] == last[key], (key, result[key], last[key])
    assert 0 < result["first_acc"] < 1  # the warm model is right on some prompts, so the comparison means something
    assert result["ledger_checked"] == last["n"] and result["ledger_failures"] == 0

    # the run's last checkpoint holds the same weights: same figures; an override changes what is evaluated
    _, from_ckpt = evaluate(os.path.join(run_dir, "checkpoints"))
    assert from_ckpt["version"] == STEPS
    assert {k: from_ckpt[k] for k in ("n", "first_acc", "solved_acc")} == {k: last[k] for k in
                                                                          ("n", "first_acc", "solved_acc")}
    _, fewer = evaluate(run_dir, "eval.max_prompts=4")
    assert fewer["n"] == 4


def test_evaluate_refuses_what_it_cannot_evaluate(tmp_path):
    out = subprocess.run([sys.executable, EVALUATE, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "neither a model folder" in out.stderr
    out = subprocess.run([sys.executable, EVALUATE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "MODEL_DIR_OR_CHECKPOINT" in out.stdout

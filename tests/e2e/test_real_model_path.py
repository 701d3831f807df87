"""The real-model path end to end on CPU: the `gsm8k` experiment on a Qwen2-shaped model folder (byte-level BPE,
Qwen2.5's chat template with tool schemas, two eos tokens) through every process, then `final/` and
`scripts/evaluate.py` on it.

The model (`arl.models.qwen2_tiny`, ~1M parameters) is taught one fixed tool conversation first, so the run sees
what a tool model writes: a `<tool_call>` block ended by <|im_end|>, the calculator's observation, then an answer
ended by <|endoftext|> (the generation config's second eos). It does not learn anything in the run itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.test_end_to_end import ROOT, assert_clean_run, assert_ledger_checked, read_metrics

EVALUATE = os.path.join(ROOT, "scripts", "evaluate.py")
STEPS = 2

GSM8K_SMALL = [
    "experiment=gsm8k",
    "inference.backend=torch",
    "inference.device=cpu",
    "inference.max_context_len=1024",
    "dataset.name=jsonl",
    "dataset.train_path=arl/data/samples/gsm8k_sample.jsonl",
    "dataset.test_path=arl/data/samples/gsm8k_sample.jsonl",
    "agent.args.tools=[calculator]",
    "agent.args.max_turns=3",
    "agent.args.max_total_tokens=768",
    "agent.group_size=2",
    "gen.max_new_tokens=40",
    "learner.batch_size=2",
    "learner.deepspeed.bf16=false",
    "learner.deepspeed.zero_stage=0",
    "learner.deepspeed.max_tokens_per_mb=4096",
    "rollout.verify_token_ledger=true",
    "rollout.filter_void_turns=false",  # a random-ish model: keep every group, the learner must get batches
    "rollout.filter_uniform_groups=false",
    "rollout.max_concurrent_rollouts=4",
    "eval.every_n_steps=0",
    "eval.concurrency=8",
    f"total_train_steps={STEPS}",
    "progress=false",
    "startup_timeout=240",
]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> str:
    from arl.models.qwen2_tiny import build_qwen2_tiny_dir
    from experiments.gsm8k import gsm8k_tool_demo

    return build_qwen2_tiny_dir(str(tmp_path_factory.mktemp("qwen2-tiny") / "model"), demo=gsm8k_tool_demo())


def test_folder_loads_like_a_qwen_folder(qwen_dir):
    """AutoTokenizer (Qwen2Tokenizer for this folder) and the roles' PreTrainedTokenizerFast render and tokenize a
    tool conversation alike; the tool tags survive skip_special_tokens (they are not special, as in Qwen2.5)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    from arl.tools.base import ToolSet

    auto, fast = AutoTokenizer.from_pretrained(qwen_dir), PreTrainedTokenizerFast.from_pretrained(qwen_dir)
    tools = ToolSet(["calculator", "python"]).schemas()
    msgs = [{"role": "system", "content": "Solve it."}, {"role": "user", "content": "What is  24 + 18?\n\n  ok ü"},
            {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function", "function": {"name": "calculator",
                                                              "arguments": {"expression": "24 + 18"}}}]},
            {"role": "tool", "content": "42"}]
    texts = [t.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
             for t in (auto, fast)]
    assert texts[0] == texts[1]
    assert '"name": "python"' in texts[0] and "<tool_call>\n{\"name\": \"calculator\"" in texts[0]
    assert texts[0].endswith("<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    ids = auto.encode(texts[0], add_special_tokens=False)
    assert ids == fast.encode(texts[1], add_special_tokens=False)
    assert fast.decode(ids) == texts[0]
    assert "<tool_call>" in fast.decode(ids, skip_special_tokens=True)
    assert "<|im_start|>" not in fast.decode(ids, skip_special_tokens=True)
    model = AutoModelForCausalLM.from_pretrained(qwen_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.generation_config.eos_token_id == [fast.convert_tokens_to_ids("<|im_end|>"),
                                                    fast.convert_tokens_to_ids("<|endoftext|>")]


@pytest.mark.slow
def test_gsm8k_on_a_qwen2_shaped_model(tmp_path, qwen_dir):
    run_root = str(tmp_path / "runs")
    cmd = [sys.executable, os.path.join(ROOT, "training", "main_async_ppo.py"), *GSM8K_SMALL,
           f"model.path={qwen_dir}", f"run_dir={run_root}", "run_name=run"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    run_dir = os.path.join(run_root, "run")
    assert_clean_run(proc, run_dir, STEPS)
    stats = assert_ledger_checked(run_dir)  # every token exact: the ledger ran on every trajectory, no drift
    metrics = read_metrics(run_dir)
    summary = [m for m in metrics if m["type"] == "summary"][-1]
    assert summary["finished"] and "error:TokenLedgerError" not in summary["groups"], summary["groups"]
    assert stats.get("drop_reasons", {}) == {}, stats.get("drop_reasons")

    # the whole tool path ran: calls parsed from <tool_call> blocks, calculator observations appended, answers
    # after the <|endoftext|> stop scored by math-verify (the demo's \boxed{12} is right for gsm-0 only)
    last = [m for m in metrics if m["type"] == "eval"][-1]
    tm = last["traj_means"]
    assert last["n"] == 8 and last["errors"] == {}
    assert tm["tool_calls_calculator"] > 0 and tm["obs_tokens"] > 0 and last["mean_turns"] > 1, last
    assert 0 < last["first_acc"] < 1, last
    rollout = [m for m in metrics if m["type"] == "train"][0]["rollout"]
    assert rollout["tool_calls"] > 0 and rollout["turns"] > 1, rollout

    # final/: a save_pretrained folder transformers loads as it is, holding the last step's weights
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    final = os.path.join(run_dir, "final")
    model = AutoModelForCausalLM.from_pretrained(final)
    tok = AutoTokenizer.from_pretrained(final)
    assert tok.eos_token == "<|im_end|>" and "tools" in tok.chat_template
    last_weights = load_file(os.path.join(run_dir, "weights", f"v{STEPS}.safetensors"))
    sd = model.state_dict()
    assert all(sd[k].equal(v) for k, v in last_weights.items())
    gen = GenerationConfig.from_pretrained(final)
    assert gen.eos_token_id == [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    assert gen.max_new_tokens == 40 and gen.do_sample and gen.temperature == 1.0

    # scripts/evaluate.py on final/ (the run's config.yaml is found beside it): the run's last evaluation
    out = subprocess.run([sys.executable, EVALUATE, final], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert f"eval v{STEPS}: first-answer acc {last['first_acc']:.3f}" in out.stdout
    for key in ("n", "first_acc", "solved_acc", "mean_turns", "traj_means"):
        assert result[key] == last[key], key
    assert result["ledger_checked"] == 8 and result["ledger_failures"] == 0

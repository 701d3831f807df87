"""The tool warm-up: examples rendered as the tool agent renders rollouts, and a few masked SFT steps."""

from __future__ import annotations

import math

import torch

from arl.data.word_problems import make_word_problem_splits
from arl.models.tiny import TOOL_CHARS, build_char_tokenizer, build_tiny_model
from arl.recipes.warmup_tools import render_example, tool_agent_for, warmup_tool_sft


def test_rendered_example_trains_on_assistant_tokens_only():
    tok = build_char_tokenizer(TOOL_CHARS)
    agent = tool_agent_for(tok)
    row = make_word_problem_splits(n_train=4, test_size=0, seed=1)[0][0]
    ids, mask = render_example(agent, row, "calculator")
    prompt = list(agent.prompt_ids(row))
    assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])
    assert len(ids) == len(mask) and 0 < sum(mask) < len(mask) - len(prompt)  # the observation is not trained on
    trained = tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=True)
    assert "calculator" in trained and trained.endswith(str(row["answer"]))


def test_a_few_steps_report_the_tool_eval_on_schedule():
    torch.set_num_threads(1)
    tok = build_char_tokenizer(TOOL_CHARS)
    model = build_tiny_model(len(tok), seed=0, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                             max_position_embeddings=512)
    train, test = make_word_problem_splits(n_train=16, test_size=4, seed=0)
    agent = tool_agent_for(tok)
    out = warmup_tool_sft(model, agent, train, test, target_acc=1.1, max_steps=6, batch_size=8, lr=3e-3,
                          eval_every=3, p_python=0.0)
    assert out["steps"] == 6 and not out["reached_target"]
    assert [h["step"] for h in out["history"]] == [3, 6]
    assert set(out["history"][0]) == {"step", "loss", "accuracy", "tool_call_rate"}
    assert math.isfinite(out["final_loss"]) and 0.0 <= out["tool_call_rate"] <= 1.0

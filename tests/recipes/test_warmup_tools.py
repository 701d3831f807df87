"""The tool warm-up: examples rendered as the tool agent renders rollouts, and a few masked SFT steps."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from arl.data.word_problems import make_word_problem_splits
from arl.models.tiny import TOOL_CHARS, build_char_tokenizer, build_tiny_model
from arl.recipes.warmup_tools import (TOOL_WARMUP_FORMAT, get_warm_tool_model, render_answer_turn, render_example,
                                      tool_agent_for, warmup_tool_sft)


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


def test_the_answer_turn_alone_is_the_tail_of_the_tool_example():
    tok = build_char_tokenizer(TOOL_CHARS)
    agent = tool_agent_for(tok)
    row = make_word_problem_splits(n_train=4, test_size=0, seed=2)[0][0]
    ids, mask = render_answer_turn(agent, row)
    for mode in ("calculator", "python"):
        full_ids, full_mask = render_example(agent, row, mode)
        assert full_ids[-len(ids):] == ids and full_mask[-len(mask):] == mask
    assert tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=True) == str(row["answer"])
    assert 0 < sum(mask) < len(mask) < 40


def test_the_cache_key_holds_the_training_settings(tmp_path):
    torch.set_num_threads(1)
    kw = dict(max_steps=1, test_size=4, num_threads=1)
    first = get_warm_tool_model(str(tmp_path), **kw)
    assert json.load(open(os.path.join(first, "warmup.json")))["settings"]["format"] == TOOL_WARMUP_FORMAT
    assert get_warm_tool_model(str(tmp_path), **kw) == first
    assert get_warm_tool_model(str(tmp_path), **kw, lr=1e-3) != first


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_warmup_reaches_its_target_from_an_empty_cache(tmp_path):
    """What broke (issue 24): from scratch the recipe stopped at 1,500 steps below its target (0.17 < 0.30);
    the copy it needs formed late or not at all. Counted in steps, not seconds."""
    path = get_warm_tool_model(str(tmp_path), seed=0, target_acc=0.3, max_steps=500, num_threads=1)
    info = json.load(open(os.path.join(path, "warmup.json")))
    assert info["reached_target"] and info["accuracy"] >= 0.3, info["history"]

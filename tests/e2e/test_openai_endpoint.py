"""End to end: agents written against the OpenAI and Anthropic APIs (experiments openai-math, anthropic-math,
openai-tool-calc, openai-framework, responses-framework) and an agent that runs a process per session, trained
through every role as a process, each trajectory through the token ledger."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from tests.e2e.test_end_to_end import (SMALL, assert_clean_run, assert_ledger_checked, model_cache,  # noqa: F401
                                       read_metrics, run_main)


# a shorter tool warm-up than the experiments' (1500 steps at most, 30+ min on a loaded 2-core machine): after 200
# steps the tiny model already writes hermes calls most of the time, which is what these tests check (shared by
# both tests: same settings, one cached warm-up per test session). It answers ~2% right, so nearly every group has
# equal rewards: without the uniform-group filter the steps come at the rollout's pace instead of one per ~8 groups
TOOL_WARMUP = ["model.warmup_max_steps=200", "agent.args.filter_uniform_groups=false",
               "rollout.filter_uniform_groups=false"]


def endpoint_stats(run_dir: str) -> dict:
    evals = [m for m in read_metrics(run_dir) if m["type"] == "eval"]
    return evals[-1].get("roles", {}).get("rollout0", {}).get("endpoint", {})


@pytest.mark.slow
def test_anthropic_math_trains_through_the_endpoint_token_exactly(tmp_path, model_cache):
    """The Anthropic SDK's agent through /v1/messages (openai-math's token-exactness is checked by its learning
    test below, on the same run that must learn)."""
    steps = 3
    proc, run_dir = run_main(["experiment=anthropic-math", f"total_train_steps={steps}", *SMALL], str(tmp_path),
                             model_cache)
    train = assert_clean_run(proc, run_dir, steps)
    assert_ledger_checked(run_dir)
    ep = endpoint_stats(run_dir)
    assert ep["requests"] > 0 and ep.get("endpoint_prefix_mismatch", 0) == 0 and ep.get("http_400", 0) == 0, ep
    rollouts = [m["rollout"] for m in train if m["rollout"]]
    assert all(r["endpoint_prefix_mismatch"] == 0 for r in rollouts) and any(r["turns"] > 1 for r in rollouts)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_openai_math_learns_from_the_default_warm_up(tmp_path, model_cache):
    """The issue's bar: >= +20 points of greedy first-answer accuracy over the warm-up checkpoint (the default run
    gets there in 25-50 steps; openai-math and anthropic-math measured +24 to +32.5 at step 25-50,
    docs/benchmarks.md); 50 steps, the best of the later evaluations."""
    proc, run_dir = run_main(["experiment=openai-math", "total_train_steps=50", "eval.every_n_steps=25",
                              "progress=false", "startup_timeout=240", "rollout.verify_token_ledger=true"],
                             str(tmp_path), model_cache, timeout=1500)
    train = assert_clean_run(proc, run_dir, 50)
    assert_ledger_checked(run_dir)  # every trajectory of the SDK agent is the engine's tokens exactly
    ep = endpoint_stats(run_dir)
    assert ep["requests"] > 0 and ep.get("endpoint_prefix_mismatch", 0) == 0 and ep.get("http_400", 0) == 0, ep
    rollouts = [m["rollout"] for m in train if m["rollout"]]
    assert all(r["endpoint_prefix_mismatch"] == 0 for r in rollouts) and any(r["turns"] > 1 for r in rollouts)
    evals = [m for m in read_metrics(run_dir) if m["type"] == "eval"]
    first, best = evals[0]["first_acc"], max(m["first_acc"] for m in evals[1:])
    assert best >= first + 0.20, [(m["version"], m["first_acc"]) for m in evals]


@pytest.mark.slow
@pytest.mark.timeout(3000)  # the tool model's warm-up (once per test session, shared with the framework test)
def test_openai_tool_calc_parses_tool_calls(tmp_path, model_cache):
    steps = 16  # enough groups to see parsed tool calls in the train records (smoke, not learning)
    proc, run_dir = run_main(["experiment=openai-tool-calc", f"total_train_steps={steps}", *TOOL_WARMUP,
                              "eval.every_n_steps=8", "eval.max_prompts=50", "progress=false", "startup_timeout=600"], str(tmp_path),
                             model_cache, timeout=2900)
    train = assert_clean_run(proc, run_dir, steps)
    assert_ledger_checked(run_dir)  # the experiment sets rollout.verify_token_ledger=true
    rollouts = [m["rollout"] for m in train if m["rollout"]]
    assert sum(r["tool_calls"] for r in rollouts) > 0, rollouts
    assert endpoint_stats(run_dir)["tool_calls"] > 0


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_responses_framework_agent_trains(tmp_path, model_cache):
    """The OpenAI Agents SDK on its default model provider (the Responses API) with function tools; the same agent
    on the SDK's chat completions model class (experiment=openai-framework) differs only in the client calls that
    tests/rollout/test_dialects.py and the openai-tool-calc test cover."""
    pytest.importorskip("agents")
    steps = 10
    proc, run_dir = run_main(["experiment=responses-framework", f"total_train_steps={steps}", *TOOL_WARMUP,
                              "eval.every_n_steps=5", "eval.max_prompts=30", "progress=false", "startup_timeout=600"], str(tmp_path),
                             model_cache, timeout=2900)
    assert_clean_run(proc, run_dir, steps)
    assert_ledger_checked(run_dir)
    ep = endpoint_stats(run_dir)
    assert ep["responses_calls"] > 0 and ep.get("endpoint_prefix_mismatch", 0) == 0, ep


SUBPROCESS_AGENT = '''
import asyncio, json, os, sys

from arl.api.registry import register_agent

# what a program does with the session's base_url and api_key (stdlib HTTP: the OpenAI SDK's import alone costs ~1.7 s
# of CPU per process here, and the test is about how many run at once, not about the SDK)
SCRIPT = """
import json, os, sys, urllib.request
body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": sys.argv[1]}]}).encode()
req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=body,
                             headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
                                      "Content-Type": "application/json"})
print(json.load(urllib.request.urlopen(req, timeout=120))["choices"][0]["message"]["content"])
"""
LIVE = {"now": 0, "peak": 0}


async def subprocess_math(base_url, api_key, prompt, env):
    LIVE["now"] += 1
    LIVE["peak"] = max(LIVE["peak"], LIVE["now"])
    with open("peak.json", "w") as f:
        json.dump(LIVE, f)
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", SCRIPT, prompt["prompt"], stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key})
        out, _ = await proc.communicate()
    finally:
        LIVE["now"] -= 1
    _, reward, _, _, info = await env.step(out.decode().strip())
    return {"reward": reward, "solved": bool(info.get("correct")), "first_correct": bool(info.get("correct"))}


register_agent("subprocess-math", subprocess_math)
'''


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_process_per_session_agent_is_capped_and_trains(tmp_path, model_cache):
    """An agent that starts a process per session, given base_url / api_key: the worker runs at most
    rollout.max_concurrent_sessions (auto: 4 per CPU) at once, and the run trains its 20 steps."""
    user_dir = tmp_path / "user"
    user_dir.mkdir()
    (user_dir / "sub_agents.py").write_text(textwrap.dedent(SUBPROCESS_AGENT))
    steps = 20
    proc, run_dir = run_main(["imports=[sub_agents]", "agent.name=subprocess-math", f"total_train_steps={steps}",
                              *SMALL, "eval.every_n_steps=20", "eval.max_prompts=8",
                              "rollout.max_concurrent_rollouts=16"],
                             str(tmp_path / "runs"), model_cache, cwd=str(user_dir), timeout=540)
    assert_clean_run(proc, run_dir, steps)
    assert_ledger_checked(run_dir)
    with open(user_dir / "peak.json") as f:
        peak = json.load(f)["peak"]
    assert 1 <= peak <= 4 * (os.cpu_count() or 1), peak
    ep = endpoint_stats(run_dir)
    assert ep["requests"] > 0 and ep["sessions_running"] <= 4 * (os.cpu_count() or 1), ep

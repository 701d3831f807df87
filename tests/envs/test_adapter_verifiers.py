"""verifiers adapter: a tiny verifiers SingleTurnEnv (tests/envs/vf_tiny_env.py) as the data set, its rollout loop
run against the endpoint, its rubric as the reward, through every role."""

from __future__ import annotations

import asyncio
import json
import math

import pytest

pytest.importorskip("verifiers")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from arl.envs.verifiers_env import verifiers_agent, verifiers_splits  # noqa: E402
from tests.e2e.test_end_to_end import model_cache  # noqa: E402,F401 - the session's warm tiny model
from tests.envs.adapter_run import refused, run_adapter  # noqa: E402

TINY = "tests.envs.vf_tiny_env:load_environment"


def fake_openai(answer: str, seen: list[dict], status: int = 200) -> "openai.AsyncOpenAI":
    """A real AsyncOpenAI whose HTTP goes to a handler that always answers `answer` (and records the requests)."""
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        if status != 200:
            return httpx.Response(status, json={"error": {"message": "refused", "type": "invalid_request_error"}})
        return httpx.Response(200, json={
            "id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": answer}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
    return openai.AsyncOpenAI(base_url="http://endpoint.invalid/v1", api_key="k",
                              http_client=httpx.AsyncClient(transport=httpx.MockTransport(handle)))


def test_rows_carry_the_environment_and_the_rubric_scores_the_rollout():
    train, test = verifiers_splits(TINY, {"size": 8, "seed": 1}, train_size=5, test_size=3)
    assert len(train) == 5 and len(test) == 3
    row = train[0]
    assert row["messages"][-1] == {"role": "user", "content": row["prompt"]} and row["prompt"].endswith("=")
    assert row["vf_env"] == TINY and row["vf_args"] == {"size": 8, "seed": 1}
    json.dumps(train)  # rows travel through the codec: plain data only

    seen: list[dict] = []
    right = asyncio.run(verifiers_agent(fake_openai(row["answer"], seen), row, max_tokens=6))
    wrong = asyncio.run(verifiers_agent(fake_openai("nope", seen), row))
    assert right["reward"] == 1.0 and wrong["reward"] == 0.0
    assert seen[0]["messages"][-1]["content"] == row["prompt"] and seen[0]["model"] == "policy"
    assert seen[0].get("max_completion_tokens", seen[0].get("max_tokens")) == 6


def test_a_rollout_verifiers_reports_as_failed_raises_so_its_group_is_dropped():
    (row,) = verifiers_splits(TINY, {"size": 1}, train_size=1)[0]
    with pytest.raises(RuntimeError, match="verifiers rollout failed"):
        asyncio.run(verifiers_agent(fake_openai("", [], status=400), row))


def test_rows_of_another_data_set_are_refused_by_the_agent():
    with pytest.raises(ValueError, match="dataset.name=verifiers"):
        asyncio.run(verifiers_agent(fake_openai("1", []), {"id": "1+1", "prompt": "1+1=", "answer": "2"}))


def test_unknown_environment_is_refused_at_startup_with_the_name():
    p = refused(["dataset.name=verifiers", "dataset.verifiers_env=no-such-vf-env", "agent.name=verifiers"])
    assert p.returncode == 2 and "no-such-vf-env" in p.stderr, p.stderr[-2000:]


@pytest.mark.slow
def test_a_verifiers_env_trains_with_its_rubric_rewards_in_the_train_records(tmp_path, model_cache):  # noqa: F811
    _, train = run_adapter(tmp_path, model_cache, [
        "dataset.name=verifiers", f"dataset.verifiers_env={TINY}", "dataset.verifiers_args={size: 64}",
        "dataset.test_size=4", "agent.name=verifiers", "agent.args={max_tokens: 4}"], steps=4)
    rollouts = [m["rollout"] for m in train if m.get("rollout")]
    assert sum(r["n_traj"] for r in rollouts) >= 20, rollouts
    rewards = [r["reward"] for r in rollouts]
    assert all(math.isfinite(r) and 0.0 <= r <= 1.0 for r in rewards), rewards

"""verifiers environments (prime-rl's environment hub): their data set as prompts, their own rollout loop against the
rollout worker's OpenAI-compatible endpoint, their rubric as the reward (needs `pip install 'arl[envs]'`).

    dataset.name=verifiers dataset.verifiers_env=<env id | module:function> dataset.verifiers_args={...}
    agent.name=verifiers

The environment is `verifiers.load_environment(env_id, **args)` (an installed environment package), or
`module:function` called with the args and returning a verifiers `Environment`; it is loaded once per process. The
data set (`verifiers_splits`) is its `get_dataset()` rows (and `get_eval_dataset()` for the held-out ones): each
row keeps the prompt messages, `answer`, `info` and `example_id`, and names its environment (`vf_env`,
`vf_args`), so the agent needs no config of its own. The agent (`verifiers_agent`, an endpoint agent:
docs/openai_endpoint.md) runs `env.run_rollout` with a verifiers client over the endpoint's `openai.AsyncOpenAI`,
so every model call of the environment's loop is recorded token-exactly as the trajectory, and returns the
reward its rubric gave. An environment that cannot be loaded (an unknown env id) is refused when the run starts,
with the name.
"""

from __future__ import annotations

import functools
import importlib
import json
from typing import Any, Optional

from arl.utils.optional import import_optional

__all__ = ["load_verifiers_env", "check_env", "verifiers_splits", "verifiers_agent"]


def _vf() -> Any:
    return import_optional("verifiers.legacy", "verifiers environments need verifiers: pip install 'arl[envs]'")


@functools.lru_cache(maxsize=16)
def _load(env_id: str, args_json: str) -> Any:
    vf = _vf()
    args = json.loads(args_json)
    if ":" in env_id:
        module, _, function = env_id.partition(":")
        try:
            make = getattr(importlib.import_module(module), function)
        except (ImportError, AttributeError, ValueError) as e:
            raise ValueError(f"verifiers environment {env_id!r} cannot be imported: {e}") from None
        env = make(**args)
    else:
        try:
            env = vf.load_environment(env_id, **args)
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"verifiers environment {env_id!r} cannot be loaded: {e}") from None
    if not isinstance(env, vf.Environment):
        raise ValueError(f"verifiers environment {env_id!r} gave a {type(env).__name__}, not a verifiers Environment")
    return env


def load_verifiers_env(env_id: str, args: Optional[dict[str, Any]] = None) -> Any:
    """The environment for `env_id` and `args`, made once per process (the same id and args share it)."""
    if not env_id:
        raise ValueError("verifiers: no environment given (dataset.verifiers_env=<env id | module:function>)")
    return _load(env_id, json.dumps(dict(args or {}), sort_keys=True))


def check_env(env_id: str, args: Optional[dict[str, Any]] = None) -> None:
    """ValueError naming the environment when it cannot be loaded (an unknown env id)."""
    load_verifiers_env(env_id, args)


def _plain(value: Any) -> Any:
    """A row's value as JSON-able data (rows travel through the codec); a datasets row can hold odd types."""
    return json.loads(json.dumps(value, default=str))


def _rows(ds: Any, env_id: str, args: dict[str, Any], split: str, limit: int) -> list[dict[str, Any]]:
    rows = []
    for n, r in enumerate(ds):
        if limit > 0 and n >= limit:
            break
        messages = r["prompt"] if isinstance(r["prompt"], list) else [{"role": "user", "content": str(r["prompt"])}]
        messages = _plain(messages)
        text = next((str(m.get("content", "")) for m in reversed(messages) if m.get("role") == "user"), "")
        info = r.get("info") or {}
        rows.append({"id": f"vf-{split}-{r['example_id']}", "prompt": text, "messages": messages,
                     "answer": str(r.get("answer") or ""), "vf_info": _plain(info),
                     "vf_example_id": int(r["example_id"]), "vf_env": env_id, "vf_args": dict(args)})
    return rows


def verifiers_splits(env_id: str, args: Optional[dict[str, Any]] = None, train_size: int = 0,
                     test_size: int = 0) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train rows, test rows): the environment's data set and eval data set (its data set again when it has
    none, as verifiers does), each cut to `train_size` / `test_size` rows when > 0."""
    args = dict(args or {})
    env = load_verifiers_env(env_id, args)
    train = _rows(env.get_dataset(), env_id, args, "train", train_size)
    test = _rows(env.get_eval_dataset(), env_id, args, "test", test_size)
    if not train:
        raise ValueError(f"verifiers environment {env_id!r} has an empty data set")
    return train, test


async def verifiers_agent(client: Any, prompt: dict, max_tokens: int = 0, temperature: Optional[float] = None,
                          model: str = "policy") -> dict:
    """One rollout of the row's verifiers environment through the endpoint; the reward is its rubric's."""
    from verifiers.legacy.clients import OpenAIChatCompletionsClient

    if "vf_env" not in prompt:
        raise ValueError("the verifiers agent needs rows of dataset.name=verifiers (vf_env missing)")
    env = load_verifiers_env(str(prompt["vf_env"]), prompt.get("vf_args") or {})
    sampling: dict[str, Any] = {}
    if max_tokens > 0:
        sampling["max_tokens"] = int(max_tokens)
    if temperature is not None:
        sampling["temperature"] = float(temperature)
    rollout_input = {"prompt": list(prompt["messages"]), "example_id": int(prompt["vf_example_id"]),
                     "answer": str(prompt.get("answer") or ""), "info": prompt.get("vf_info") or {}}
    out = await env.run_rollout(rollout_input, OpenAIChatCompletionsClient(client), model, sampling)
    error = out.get("error")
    if error:
        raise RuntimeError(f"verifiers rollout failed: {error}")
    metrics = {f"vf_{k}": float(v) for k, v in (out.get("metrics") or {}).items() if isinstance(v, (int, float))}
    return {"reward": float(out["reward"] or 0.0), **metrics}

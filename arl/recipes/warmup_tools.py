"""Warm-up recipe for tool calling (the "tool-calc" experiment): SFT of the tiny model on rendered tool
conversations, and its cached builder.

The a+b warm-up (`arl.recipes.warmup_arith`) teaches `prompt -> answer<eos>`; here the model also has to learn the
hermes call format and to read the tool's observation. Each warm-up example is rendered exactly as the tool
agent renders a rollout (same prompt ids, same observation tokens from the chat template), with the loss on the
assistant turns only:

    tool example   (p_tool):   prompt | <tool_call>{"name": "calculator", "arguments": {"expression": "23+17"}}
                               </tool_call><eos> | <|user|><tool_response>40</tool_response><|assistant|> | 40<eos>
    direct example (1-p_tool): prompt | 40<eos>

Some tool examples use the python tool (`print(23+17)`) instead. The mix leaves RL something to discover: direct
answers to two-digit problems are mostly wrong for a 0.5M-parameter model, calculator answers mostly right, so
reward and tool calls per trajectory both go up as RL shifts the policy toward the tool.

Each tool example also comes as its answer turn alone (`<|user|><tool_response>40</tool_response><|assistant|>
40<eos>`, ~25 tokens). Copying a number from the context is what the tiny model must learn twice (the operands
from the prompt into the call, ~100 tokens back; the result from the observation into the answer), and in a
~170-token conversation the right position starts with ~1/170 of the attention: from scratch the copy formed
after 1,000+ steps or not within 1,500, by luck of the float trajectory. In the short answer turn it forms within
~200 steps, and the copying it learns there carries over to both copies in the full conversation.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any, Optional, Sequence

import torch

from arl.envs.math import exact_number_match
from arl.recipes.sft import greedy_generate, masked_sft, warm_model_dir

TOOL_WARMUP_FORMAT = "arl-tiny-tool-warmup-v3"  # bump when the recipe changes, so old caches are not reused


def tool_agent_for(tokenizer: Any) -> Any:
    """The ToolAgent whose rendering the warm-up copies (calculator + python, hermes parser)."""
    from arl.agents.tool_agent import ToolAgent
    from arl.api import GenerationConfig

    return ToolAgent(tokenizer, GenerationConfig(max_new_tokens=96), group_size=1, tools=["calculator", "python"])


def render_example(agent: Any, row: dict, mode: str) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one warm-up conversation; `mode` is "direct", "calculator" or "python"."""
    tok = agent.tokenizer
    eos = tok.eos_token_id
    ids: list[int] = list(agent.prompt_ids(row))
    mask = [0] * len(ids)

    def said(text: str) -> None:
        t = list(tok.encode(text, add_special_tokens=False)) + [eos]
        ids.extend(t)
        mask.extend([1] * len(t))

    if mode != "direct":
        args = {"expression": row["expression"]} if mode == "calculator" else {"code": f"print({row['expression']})"}
        said(agent.parser.format_call(mode, args))
        obs = agent.obs_encoder.encode([{"role": "tool", "content": str(row["answer"])}])
        ids.extend(obs)
        mask.extend([0] * len(obs))
    said(str(row["answer"]))
    return ids, mask


def render_answer_turn(agent: Any, row: dict) -> tuple[list[int], list[int]]:
    """The last turn of a tool example on its own: the observation (not trained on), then the answer and eos."""
    tok = agent.tokenizer
    obs = list(agent.obs_encoder.encode([{"role": "tool", "content": str(row["answer"])}]))
    answer = list(tok.encode(str(row["answer"]), add_special_tokens=False)) + [tok.eos_token_id]
    return obs + answer, [0] * len(obs) + [1] * len(answer)


async def _tool_turns(agent: Any, texts: list[str]) -> list[tuple[str, Any]]:
    """For each first-turn text: ("answer", text) | ("tool", observation ids) | ("void", None)."""
    outs: list[tuple[str, Any]] = []
    for text in texts:
        parsed = agent.parser.parse(text)
        if parsed.attempted and not parsed.unclosed:
            results = await agent.toolset.call_all(parsed.calls)
            contents = [r.content for r in results] + [f"Error: {e}" for e in parsed.errors]
            outs.append(("tool", agent.obs_encoder.encode([{"role": "tool", "content": c} for c in contents])))
        elif parsed.unclosed or not parsed.content.strip():
            outs.append(("void", None))
        else:
            outs.append(("answer", parsed.content))
    return outs


@torch.no_grad()
def tool_policy_eval(model: Any, agent: Any, rows: Sequence[dict], batch_size: int = 128) -> dict[str, float]:
    """Greedy two-turn rollouts (a tool call, then an answer) with real tool execution (the python tool runs in
    its sandbox), with the model in the mode it is in. Returns accuracy and the fraction of first turns that
    called a tool."""
    tok = agent.tokenizer
    correct = calls = 0
    for s in range(0, len(rows), batch_size):
        chunk = rows[s: s + batch_size]
        prompts = [list(agent.prompt_ids(r)) for r in chunk]
        first = greedy_generate(model, prompts, 96, tok.eos_token_id, tok.pad_token_id)
        texts = [tok.decode(o, skip_special_tokens=True) for o in first]
        kinds = asyncio.run(_tool_turns(agent, texts))
        second_idx = [i for i, (k, _) in enumerate(kinds) if k == "tool"]
        calls += len(second_idx)
        ctx = [prompts[i] + list(first[i]) + list(kinds[i][1]) for i in second_idx]
        second = greedy_generate(model, ctx, 8, tok.eos_token_id, tok.pad_token_id) if ctx else []
        answers = {i: tok.decode(o, skip_special_tokens=True) for i, o in zip(second_idx, second)}
        for i, (k, v) in enumerate(kinds):
            text = v if k == "answer" else answers.get(i)
            if text is not None:
                correct += exact_number_match(text, str(chunk[i]["answer"]))
    return {"accuracy": correct / len(rows), "tool_call_rate": calls / len(rows)}


def warmup_tool_sft(model: Any, agent: Any, train_rows: Sequence[dict], eval_rows: Sequence[dict], *,
                    target_acc: float = 0.3, max_steps: int = 1500, batch_size: int = 32, lr: float = 2e-3,
                    p_tool: float = 0.7, p_python: float = 0.2, answer_turns: bool = True, eval_every: int = 100,
                    seed: int = 0) -> dict[str, Any]:
    """Masked SFT on rendered conversations until the greedy tool-policy accuracy reaches `target_acc`. Each
    example calls a tool with probability `p_tool` (the python tool with probability `p_python` of those); with
    `answer_turns`, each tool example's answer turn is also an example of its own (see the module docstring)."""
    rng = random.Random(seed)
    examples = []
    for r in train_rows:
        mode = "direct"
        if rng.random() < p_tool:
            mode = "python" if rng.random() < p_python else "calculator"
        examples.append(render_example(agent, r, mode))
        if answer_turns and mode != "direct":
            examples.append(render_answer_turn(agent, r))
    return masked_sft(model, examples, agent.tokenizer.pad_token_id, lambda: tool_policy_eval(model, agent, eval_rows),
                      target_acc=target_acc, max_steps=max_steps, batch_size=batch_size, lr=lr,
                      eval_every=eval_every, seed=seed, lr_warmup_steps=50, log_name="tool warm-up")


def get_warm_tool_model(cache_dir: str, *, seed: int = 0, target_acc: float = 0.3, max_steps: int = 1500,
                        num_threads: Optional[int] = None, p_tool: float = 0.7, p_python: float = 0.2,
                        answer_turns: bool = True, batch_size: int = 32, lr: float = 2e-3, eval_every: int = 100,
                        test_size: int = 200, data_seed: int = 0, **_: Any) -> str:
    """Path of the tiny model (char tokenizer with TOOL_CHARS) warmed up on word problems with tool calls. The
    signature matches `model.warmup` ("arl.recipes.warmup_tools:get_warm_tool_model")."""
    from arl.data.word_problems import make_word_problem_splits
    from arl.models.tiny import CHARS, TOOL_CHARS

    model_kwargs = {"max_position_embeddings": 512}
    settings = {"format": TOOL_WARMUP_FORMAT, "seed": seed, "target_acc": target_acc, "max_steps": max_steps,
                "p_tool": p_tool, "p_python": p_python, "answer_turns": answer_turns, "batch_size": batch_size,
                "lr": lr, "eval_every": eval_every, "test_size": test_size, "data_seed": data_seed,
                "chars": CHARS + TOOL_CHARS, "model_kwargs": model_kwargs}

    def train(model: Any, tok: Any) -> dict[str, Any]:
        rows, test = make_word_problem_splits(test_size=test_size, seed=data_seed)
        return warmup_tool_sft(model, tool_agent_for(tok), rows, test[:100], target_acc=target_acc,
                               max_steps=max_steps, batch_size=batch_size, lr=lr, p_tool=p_tool, p_python=p_python,
                               answer_turns=answer_turns, eval_every=eval_every, seed=seed)

    return warm_model_dir(cache_dir, "tiny-tools", settings, "tiny tool model", train, seed=seed,
                          extra_chars=TOOL_CHARS, model_kwargs=model_kwargs, num_threads=num_threads)

"""A fixed tool conversation taught to the tiny Qwen2 model (`arl.models.qwen2_tiny.build_qwen2_tiny_dir(path,
demo=...)`), so the real-model path sees what a tool model writes: a `<tool_call>` block ended by <|im_end|>, then
after the observation an answer ended by <|endoftext|>. A recipe, not part of the model: it needs the tool agent's
observation encoding and the tools' schemas (`tool_demo(system_prompt)`: for an experiment's prompts; the gsm8k
experiment's is `experiments.gsm8k.gsm8k_tool_demo`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

import torch

from arl.models.qwen2_tiny import IM_END, PAD_TOKEN
from arl.recipes.sft import torch_threads

__all__ = ["ToolDemo", "teach_demo", "tool_demo", "GSM8K_SAMPLE"]

GSM8K_SAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "samples",
                            "gsm8k_sample.jsonl")


@dataclasses.dataclass
class ToolDemo:
    """A fixed two-turn tool conversation the random model is taught, so the real-model path sees what a tool
    model emits (tool-call blocks ended by <|im_end|>, an observation, a final answer ended by eos):

        <tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call><|im_end|>      (turn 1, after each prompt)
        \n<|im_start|>user\n<tool_response>\nRESULT\n</tool_response><|im_end|>\n<|im_start|>assistant\n
        ANSWER<|endoftext|>                                                        (turn 2)

    Turn 2 ends on <|endoftext|>, the second eos of the generation config, so a backend that stops on the
    tokenizer's eos only runs that turn to its token budget. `prompts` are the chat messages (system + user) the
    run will render with `tools`; the model learns the same reply for all of them (it does not read them)."""

    prompts: Sequence[list[dict[str, Any]]]
    tools: Sequence[dict[str, Any]] = ()
    call: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {"name": "calculator", "arguments": {"expression": "24 + 18 - 30"}})
    result: str = "12"
    answer: str = "The answer is \\boxed{12}."
    steps: int = 80
    lr: float = 3e-3
    prefix_every: int = 8  # steps between re-encodings of the prompts (their KV is a few steps stale in between)

    def texts(self) -> list[str]:
        """The schemas and prompts the tokenizer's BPE merges also learn from: shorter prompts, faster runs."""
        return [json.dumps(t) for t in self.tools] + [m.get("content", "") for p in self.prompts for m in p]

    def teach(self, model: Any, tok: Any, seed: int) -> float:
        return teach_demo(model, tok, self, seed=seed)


def _demo_sequences(tok: Any, demo: ToolDemo) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) of every demo conversation, cut exactly where the tool agent cuts its turns."""
    from arl.agents.tool_agent import ObservationEncoder

    obs = ObservationEncoder(tok).encode([{"role": "tool", "content": demo.result}])
    call = tok.encode("<tool_call>\n" + json.dumps(demo.call) + "\n</tool_call>", add_special_tokens=False)
    call += [tok.convert_tokens_to_ids(IM_END)]
    answer = tok.encode(demo.answer, add_special_tokens=False) + [tok.convert_tokens_to_ids(PAD_TOKEN)]
    out = []
    for messages in demo.prompts:
        text = tok.apply_chat_template(list(messages), tools=list(demo.tools) or None, add_generation_prompt=True,
                                       tokenize=False)
        prompt = tok.encode(text, add_special_tokens=False)
        ids = prompt + call + obs + answer
        mask = [0] * len(prompt) + [1] * len(call) + [0] * len(obs) + [1] * len(answer)
        out.append((ids, mask))
    return out


def teach_demo(model: Any, tok: Any, demo: ToolDemo, seed: int = 0) -> float:
    """AdamW steps on the demo turns (loss on the model's turns only); returns the last mean loss.

    Why the prompt runs without grad: it is most of every sequence and the reply does not depend on it, so each
    step reuses the prompt's KV cache (all but its last token, encoded under `no_grad` every `prefix_every` steps)
    and back-propagates through the rest only: a fraction of the cost of full steps, for the same imprint."""
    seqs = _demo_sequences(tok, demo)
    with torch_threads(1):  # small matrices: one thread is faster, and many times so when the cores are busy
        return _teach(model, seqs, demo, seed)


def _teach(model: Any, seqs: list[tuple[list[int], list[int]]], demo: ToolDemo, seed: int) -> float:
    from transformers import DynamicCache

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=demo.lr, betas=(0.9, 0.98))
    losses = [float("nan")]
    caches: list[Any] = [None] * len(seqs)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for step in range(demo.steps):
            opt.zero_grad()
            losses = []
            for i, (ids, mask) in enumerate(seqs):
                cut = mask.index(1) - 1  # the last prompt token predicts the first reply token: it needs grad
                ids_t = torch.tensor([ids])
                if step % demo.prefix_every == 0:
                    prefix = DynamicCache(config=model.config)
                    with torch.no_grad():
                        model(input_ids=ids_t[:, :cut], past_key_values=prefix, use_cache=True)
                    caches[i] = [(layer.keys, layer.values) for layer in prefix.layers]
                cache = DynamicCache(config=model.config)
                for layer, (k, v) in enumerate(caches[i]):
                    cache.update(k, v, layer)
                labels = torch.tensor([[t if m else -100 for t, m in zip(ids[cut:], mask[cut:])]])
                loss = model(input_ids=ids_t[:, cut:], past_key_values=cache, use_cache=True,
                             position_ids=torch.arange(cut, len(ids)).unsqueeze(0), labels=labels).loss
                (loss / len(seqs)).backward()
                losses.append(float(loss.detach()))
            opt.step()
    model.eval()
    return sum(losses) / len(losses)


def tool_demo(system_prompt: str, rows_path: str = GSM8K_SAMPLE, *, tools: Sequence[str] = ("calculator",),
              num_prompts: int = 3, steps: int = 80) -> ToolDemo:
    """The `ToolDemo` for an experiment's prompts (`system_prompt`, the first `num_prompts` rows of `rows_path`, the
    schemas of `tools` as the tool agent renders them). Its fixed reply computes 24 + 18 - 30 and answers
    \\boxed{12}: right for the gsm8k sample's first row, wrong for the others."""
    from arl.tools.base import ToolSet

    with open(rows_path) as f:
        rows = [json.loads(line) for line in f if line.strip()][:num_prompts]
    prompts = [[{"role": "system", "content": system_prompt}, {"role": "user", "content": r["prompt"]}] for r in rows]
    return ToolDemo(prompts=prompts, tools=ToolSet(list(tools)).schemas(), steps=steps)

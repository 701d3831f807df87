"""Warm-up recipe for a+b (the default `model.warmup`): SFT of the tiny model on chat-formatted
`prompt -> answer<eos>`, and its cached builder.

RL from a 0/1 reward needs a policy that is sometimes right: `get_warm_model` trains the random tiny Llama
until its greedy accuracy on the held-out split reaches `target_acc` (~30%), saves it, and reuses it afterwards.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from arl.agents.common import encode_chat, row_messages
from arl.envs.math import exact_number_match
from arl.recipes.sft import greedy_generate, masked_sft, warm_model_dir

WARMUP_FORMAT = "arl-tiny-warmup-v1"  # bump when the recipe changes, so old caches are not reused


def encode_sft_row(tokenizer: Any, row: dict) -> tuple[list[int], list[int]]:
    """(prompt ids incl. the generation prompt, target ids = answer + end-of-turn) from the chat template."""
    messages = row_messages(row)
    prompt = encode_chat(tokenizer, messages, add_generation_prompt=True)
    full = encode_chat(tokenizer, messages + [{"role": "assistant", "content": str(row["answer"])}],
                       add_generation_prompt=False)
    if full[: len(prompt)] != prompt or len(full) == len(prompt):
        raise ValueError("chat template: the generation prompt is not a prefix of the rendered assistant turn")
    return prompt, full[len(prompt):]


@torch.no_grad()
def greedy_accuracy(model: Any, tokenizer: Any, rows: Sequence[dict], max_new_tokens: int = 4,
                    batch_size: int = 256) -> float:
    """Fraction of `rows` whose greedy completion states the right number (`exact_number_match`), with the model
    in the mode it is in (`masked_sft` evaluates in eval mode)."""
    if not rows:
        raise ValueError("greedy_accuracy needs at least one row")
    correct = 0.0
    for s in range(0, len(rows), batch_size):
        chunk = rows[s: s + batch_size]
        prompts = [encode_chat(tokenizer, row_messages(r), add_generation_prompt=True) for r in chunk]
        outs = greedy_generate(model, prompts, max_new_tokens, tokenizer.eos_token_id, tokenizer.pad_token_id)
        for r, o in zip(chunk, outs):
            correct += exact_number_match(tokenizer.decode(o, skip_special_tokens=True), str(r["answer"]))
    return correct / len(rows)


def get_warm_model(cache_dir: str, *, seed: int = 0, target_acc: float = 0.30, max_steps: int = 400,
                   batch_size: int = 64, lr: float = 1e-3, eval_every: int = 25, max_operand: int = 49,
                   test_size: int = 200, data_seed: int = 0, model_kwargs: Optional[dict[str, Any]] = None,
                   num_threads: Optional[int] = None) -> str:
    """Path of a warmed-up tiny model folder (HF format, loadable with `load_model_dir`).

    The folder is `cache_dir/tiny-<hash of the settings>/`. It is built in a temporary folder, a marker file is
    written last and the folder renamed into place, under a file lock, so a crashed or concurrent build is never
    reused half-done. `warmup.json` in the folder records the settings and the reached accuracy. The held-out
    split is `make_arith_splits(max_operand, test_size, seed=data_seed)[1]` (the same the experiments evaluate on).

    The warm-up trains on `prompt -> answer<eos>` of the train split (loss on the answer tokens only) until the
    greedy accuracy on the held-out split, checked every `eval_every` steps, is >= `target_acc`, or `max_steps`
    is reached.
    """
    from arl.data.arith import make_arith_splits
    from arl.models.tiny import CHARS

    settings = {"format": WARMUP_FORMAT, "seed": seed, "target_acc": target_acc, "max_steps": max_steps,
                "batch_size": batch_size, "lr": lr, "eval_every": eval_every, "max_operand": max_operand,
                "test_size": test_size, "data_seed": data_seed,
                "model_kwargs": dict(sorted((model_kwargs or {}).items())), "chars": CHARS}

    def train(model: Any, tok: Any) -> dict[str, Any]:
        rows, test = make_arith_splits(max_operand=max_operand, test_size=test_size, seed=data_seed)
        examples = [(p + t, [0] * len(p) + [1] * len(t)) for p, t in (encode_sft_row(tok, r) for r in rows)]
        return masked_sft(model, examples, tok.pad_token_id, lambda: {"accuracy": greedy_accuracy(model, tok, test)},
                          target_acc=target_acc, max_steps=max_steps, batch_size=batch_size, lr=lr,
                          eval_every=eval_every, seed=seed, log_name="warm-up")

    return warm_model_dir(cache_dir, "tiny", settings, "tiny model", train, seed=seed, model_kwargs=model_kwargs,
                          num_threads=num_threads)

"""Warm-up recipe for a+b (the default `model.warmup`): SFT of the tiny model on chat-formatted
`prompt -> answer<eos>`, and its cached builder.

RL from a 0/1 reward needs a policy that is sometimes right: `get_warm_model` trains the random tiny Llama
until its greedy accuracy on the held-out split reaches `target_acc` (~30%), saves it, and reuses it afterwards.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch

from arl.agents.common import encode_chat, row_messages
from arl.envs.math import exact_number_match
from arl.recipes.sft import cached_model_dir, greedy_generate, masked_sft, save_warm_model, torch_threads

logger = logging.getLogger(__name__)

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
    """Fraction of `rows` whose greedy completion states the right number (`exact_number_match`)."""
    if not rows:
        raise ValueError("greedy_accuracy needs at least one row")
    was_training = model.training
    model.eval()
    correct = 0.0
    try:
        for s in range(0, len(rows), batch_size):
            chunk = rows[s: s + batch_size]
            prompts = [encode_chat(tokenizer, row_messages(r), add_generation_prompt=True) for r in chunk]
            outs = greedy_generate(model, prompts, max_new_tokens, tokenizer.eos_token_id, tokenizer.pad_token_id)
            for r, o in zip(chunk, outs):
                correct += exact_number_match(tokenizer.decode(o, skip_special_tokens=True), str(r["answer"]))
    finally:
        model.train(was_training)
    return correct / len(rows)


def warmup_sft(model: Any, tokenizer: Any, train_rows: Sequence[dict], *, target_acc: float = 0.30,
               max_steps: int = 400, batch_size: int = 64, lr: float = 1e-3, eval_rows: Sequence[dict], seed: int = 0,
               eval_every: int = 25, max_new_tokens: int = 4) -> dict[str, Any]:
    """Train on `prompt -> answer<eos>` (loss on the answer tokens only) until greedy accuracy on `eval_rows`,
    checked every `eval_every` steps, is >= `target_acc`, or `max_steps` is reached.

    Returns {"steps", "seconds", "accuracy", "reached_target", "history": [{"step", "loss", "accuracy"}]}.
    """
    if not train_rows:
        raise ValueError("warmup_sft needs training rows")
    examples = [(p + t, [0] * len(p) + [1] * len(t)) for p, t in (encode_sft_row(tokenizer, r) for r in train_rows)]

    def evaluate() -> dict[str, float]:
        return {"accuracy": greedy_accuracy(model, tokenizer, eval_rows, max_new_tokens=max_new_tokens)}

    return masked_sft(model, examples, tokenizer.pad_token_id, evaluate, target_acc=target_acc, max_steps=max_steps,
                      batch_size=batch_size, lr=lr, eval_every=eval_every, seed=seed, log_name="warm-up")


def get_warm_model(cache_dir: str, *, seed: int = 0, target_acc: float = 0.30, max_steps: int = 400,
                   batch_size: int = 64, lr: float = 1e-3, eval_every: int = 25, max_operand: int = 49,
                   test_size: int = 200, data_seed: int = 0, model_kwargs: Optional[dict[str, Any]] = None,
                   num_threads: Optional[int] = None) -> str:
    """Path of a warmed-up tiny model folder (HF format, loadable with `load_model_dir`).

    The folder is `cache_dir/tiny-<hash of the settings>/`. It is built in a temporary folder, a marker file is
    written last and the folder renamed into place, under a file lock, so a crashed or concurrent build is never
    reused half-done. `warmup.json` in the folder records the settings and the reached accuracy. The held-out
    split is `make_arith_splits(max_operand, test_size, seed=data_seed)[1]` (the same the experiments evaluate on).
    """
    from arl.data.arith import make_arith_splits
    from arl.models.tiny import CHARS, build_char_tokenizer, build_tiny_model

    settings = {"format": WARMUP_FORMAT, "seed": seed, "target_acc": target_acc, "max_steps": max_steps,
                "batch_size": batch_size, "lr": lr, "eval_every": eval_every, "max_operand": max_operand,
                "test_size": test_size, "data_seed": data_seed,
                "model_kwargs": dict(sorted((model_kwargs or {}).items())), "chars": CHARS}

    def build(tmp: str) -> dict:
        with torch_threads(num_threads):
            train, test = make_arith_splits(max_operand=max_operand, test_size=test_size, seed=data_seed)
            tok = build_char_tokenizer()
            model = build_tiny_model(len(tok), seed=seed, pad_token_id=tok.pad_token_id,
                                     eos_token_id=tok.eos_token_id, **(model_kwargs or {}))
            logger.info("warming up the tiny model into %s", cache_dir)
            result = warmup_sft(model, tok, train, target_acc=target_acc, max_steps=max_steps,
                                batch_size=batch_size, lr=lr, eval_rows=test, seed=seed, eval_every=eval_every)
            return save_warm_model(model, tok, tmp, result, "tiny-model warm-up")

    return cached_model_dir(cache_dir, "tiny", settings, build)

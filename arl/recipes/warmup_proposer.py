"""Warm-up recipe for the proposer-solver experiment: the a+b warm-up (`warmup_arith`), plus the proposer's
format.

Besides `a+b= -> answer<eos>` on the train split, the model sees as many `propose a+ -> b=<eos>` examples, each a
train problem drawn at random, so it starts as a solver at the default's level (greedy held-out accuracy
`target_acc`, ~30%) and a proposer of random problems in the task's range. Which problems teach it most is what RL
finds (`arl.agents.proposer_solver`).
"""

from __future__ import annotations

import random
from typing import Any, Optional

from arl.agents.common import encode_chat
from arl.agents.proposer_solver import propose_prompt
from arl.recipes.sft import masked_sft, warm_model_dir
from arl.recipes.warmup_arith import encode_sft_row, greedy_accuracy

PROPOSER_WARMUP_FORMAT = "arl-tiny-proposer-warmup-v2"  # bump when the recipe changes, so old caches are not reused


def get_warm_proposer_model(cache_dir: str, *, seed: int = 0, target_acc: float = 0.30, max_steps: int = 600,
                            batch_size: int = 64, lr: float = 1e-3, eval_every: int = 25, max_operand: int = 49,
                            test_size: int = 200, num_threads: Optional[int] = None,
                            model_kwargs: Optional[dict[str, Any]] = None) -> str:
    """Path of the warmed-up tiny model folder (cached like `warmup_arith.get_warm_model`)."""
    from arl.data.arith import make_arith_splits
    from arl.models.tiny import CHARS

    settings = {"format": PROPOSER_WARMUP_FORMAT, "seed": seed, "target_acc": target_acc, "max_steps": max_steps,
                "batch_size": batch_size, "lr": lr, "eval_every": eval_every, "max_operand": max_operand,
                "test_size": test_size, "model_kwargs": dict(sorted((model_kwargs or {}).items())), "chars": CHARS}

    def train(model: Any, tok: Any) -> dict[str, Any]:
        rows, test = make_arith_splits(max_operand=max_operand, test_size=test_size, seed=0)
        examples = [(p + t, [0] * len(p) + [1] * len(t)) for p, t in (encode_sft_row(tok, r) for r in rows)]
        rng = random.Random(seed)
        for _ in range(len(rows)):
            a, b = rng.choice(rows)["prompt"].rstrip("=").split("+")
            propose = encode_chat(tok, [{"role": "user", "content": propose_prompt(int(a))}])
            target = list(tok.encode(f"{b}=", add_special_tokens=False)) + [tok.eos_token_id]
            examples.append((propose + target, [0] * len(propose) + [1] * len(target)))
        return masked_sft(model, examples, tok.pad_token_id, lambda: {"accuracy": greedy_accuracy(model, tok, test)},
                          target_acc=target_acc, max_steps=max_steps, batch_size=batch_size, lr=lr,
                          eval_every=eval_every, seed=seed, log_name="proposer warm-up")

    return warm_model_dir(cache_dir, "tiny-proposer", settings, "tiny model (proposer-solver)", train, seed=seed,
                          model_kwargs=model_kwargs, num_threads=num_threads)

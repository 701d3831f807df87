"""Warm-up recipe for the self-play experiment: the tiny model learns Nim's move format and legal moves, not how
to win.

Self-play RL from a 0/1 reward needs players that finish games. The warm-up plays random legal games (each player
takes 1 to `max_take` stones, uniformly, never more than are left) and trains on each seat's chat exactly as the
self-play agent renders it (`<|user|>pile 12<|assistant|>2<eos><|user|>pile 7<|assistant|>...`), with the loss on
the moves. The model ends as a near-uniform random legal player: strategy (take `pile % (max_take + 1)`) is what RL
has to find. It stops once the probability of a legal first move token, averaged over the piles 1..`max_pile`,
reaches `target_acc`.
"""

from __future__ import annotations

import random
from typing import Any, Optional

import torch

from arl.agents.common import encode_chat
from arl.recipes.sft import masked_sft, warm_model_dir

NIM_WARMUP_FORMAT = "arl-tiny-nim-warmup-v1"  # bump when the recipe changes, so old caches are not reused


def random_game_chats(tokenizer: Any, pile: int, max_take: int, rng: random.Random) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) of both seats' chats of one random legal game from `pile`."""
    eos = tokenizer.eos_token_id
    chats: list[tuple[list[int], list[int]]] = [([], []), ([], [])]
    seat = 0
    while pile > 0:
        ids, mask = chats[seat]
        turn = encode_chat(tokenizer, [{"role": "user", "content": f"pile {pile}"}], add_generation_prompt=True)
        take = rng.randint(1, min(max_take, pile))
        move = list(tokenizer.encode(str(take), add_special_tokens=False)) + [eos]
        ids.extend(turn + move)
        mask.extend([0] * len(turn) + [1] * len(move))
        pile -= take
        seat = 1 - seat
    return [c for c in chats if c[0]]


@torch.no_grad()
def legal_mass(model: Any, tokenizer: Any, max_pile: int, max_take: int) -> float:
    """The probability the model's first move token is a legal move (a digit 1..min(max_take, pile)), averaged
    over the piles 1..max_pile: what sampled self-play sees (the greedy move is legal long before)."""
    from arl.inference.torch_engine import left_pad

    prompts = [encode_chat(tokenizer, [{"role": "user", "content": f"pile {p}"}], add_generation_prompt=True)
               for p in range(1, max_pile + 1)]
    device = next(model.parameters()).device
    ids, mask, pos = left_pad(prompts, tokenizer.pad_token_id, device)
    probs = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].float().softmax(-1)
    digits = [tokenizer.convert_tokens_to_ids(str(d)) for d in range(1, max_take + 1)]
    legal = [float(probs[i, digits[: min(max_take, p)]].sum()) for i, p in enumerate(range(1, max_pile + 1))]
    return sum(legal) / len(legal)


def get_warm_nim_model(cache_dir: str, *, seed: int = 0, target_acc: float = 0.97, max_steps: int = 300,
                       num_threads: Optional[int] = None, min_pile: int = 5, max_pile: int = 20, max_take: int = 3,
                       games: int = 4000, batch_size: int = 64, lr: float = 1e-3, eval_every: int = 25,
                       model_kwargs: Optional[dict[str, Any]] = None) -> str:
    """Path of the warmed-up tiny model folder for Nim (cached like `warmup_arith.get_warm_model`)."""
    from arl.models.tiny import CHARS

    settings = {"format": NIM_WARMUP_FORMAT, "seed": seed, "target_acc": target_acc, "max_steps": max_steps,
                "min_pile": min_pile, "max_pile": max_pile, "max_take": max_take, "games": games,
                "batch_size": batch_size, "lr": lr, "eval_every": eval_every,
                "model_kwargs": dict(sorted((model_kwargs or {}).items())), "chars": CHARS}

    def train(model: Any, tok: Any) -> dict[str, Any]:
        rng = random.Random(seed)
        examples = [c for _ in range(games)
                    for c in random_game_chats(tok, rng.randint(min_pile, max_pile), max_take, rng)]
        return masked_sft(model, examples, tok.pad_token_id,
                          lambda: {"accuracy": legal_mass(model, tok, max_pile, max_take)},
                          target_acc=target_acc, max_steps=max_steps, batch_size=batch_size, lr=lr,
                          eval_every=eval_every, seed=seed, log_name="nim warm-up")

    return warm_model_dir(cache_dir, "tiny-nim", settings, "tiny model (nim)", train, seed=seed,
                          model_kwargs=model_kwargs, num_threads=num_threads)

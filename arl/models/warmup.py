"""Supervised warm-up of the tiny model on chat-formatted `prompt -> answer<eos>`, and a cached builder.

RL from a 0/1 reward needs a policy that is sometimes right: `get_warm_model` trains the random tiny Llama
until its greedy accuracy on the held-out split reaches `target_acc` (~30%), saves it, and reuses it afterwards.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import random
import shutil
import time
from typing import Any, Callable, Optional, Sequence

import torch

from arl.agents.common import encode_chat, row_messages
from arl.envs.math import exact_number_match

logger = logging.getLogger(__name__)

WARMUP_FORMAT = "arl-tiny-warmup-v1"  # bump when the recipe changes, so old caches are not reused
MARKER = "WARMUP_COMPLETE"
INFO_FILE = "warmup.json"


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
def greedy_generate(
    model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_token_id: int, pad_token_id: int
) -> list[list[int]]:
    """Batched greedy decoding with plain HF forward calls (left padding, KV cache). Each output stops after
    (and includes) its first eos."""
    if not prompts:
        return []
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.as_tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(device), mask.to(device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
    past = out.past_key_values
    nxt = out.logits[:, -1].argmax(-1)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    gen: list[list[int]] = [[] for _ in prompts]
    pos = pos[:, -1:]
    for step in range(max_new_tokens):
        for i in range(len(prompts)):
            if not done[i]:
                gen[i].append(int(nxt[i]))
        done |= nxt == eos_token_id
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones((len(prompts), 1), dtype=mask.dtype, device=device)], dim=1)
        pos = pos + 1
        out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos, past_key_values=past,
                    use_cache=True)
        past = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1)
    return gen


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


def warmup_sft(
    model: Any,
    tokenizer: Any,
    train_rows: Sequence[dict],
    *,
    target_acc: float = 0.30,
    max_steps: int = 400,
    batch_size: int = 64,
    lr: float = 1e-3,
    eval_rows: Sequence[dict],
    seed: int = 0,
    eval_every: int = 25,
    max_new_tokens: int = 4,
) -> dict[str, Any]:
    """Train on `prompt -> answer<eos>` (loss on the answer tokens only) until greedy accuracy on `eval_rows`,
    checked every `eval_every` steps, is >= `target_acc`, or `max_steps` is reached.

    Returns {"steps", "seconds", "accuracy", "reached_target", "history": [{"step", "loss", "accuracy"}]}.
    """
    if not train_rows:
        raise ValueError("warmup_sft needs training rows")
    examples = []
    for r in train_rows:
        p, t = encode_sft_row(tokenizer, r)
        examples.append((p + t, [0] * len(p) + [1] * len(t)))

    def evaluate() -> dict[str, float]:
        return {"accuracy": greedy_accuracy(model, tokenizer, eval_rows, max_new_tokens=max_new_tokens)}

    return masked_sft(model, examples, tokenizer.pad_token_id, evaluate, target_acc=target_acc, max_steps=max_steps,
                      batch_size=batch_size, lr=lr, eval_every=eval_every, seed=seed, log_name="warm-up")


def masked_sft(model: Any, examples: Sequence[tuple[list[int], list[int]]], pad_token_id: int,
               evaluate: Callable[[], dict[str, float]], *, target_acc: float, max_steps: int, batch_size: int,
               lr: float, eval_every: int, seed: int, lr_warmup_steps: int = 0,
               log_name: str = "warm-up") -> dict[str, Any]:
    """The warm-up loop both tiny-model recipes share: shuffled passes over `examples` (token ids, loss mask),
    AdamW with gradient clipping (and an optional linear LR warm-up), `evaluate()` every `eval_every` steps until
    its "accuracy" reaches `target_acc` or `max_steps` is reached.

    Returns {"steps", "seconds", "reached_target", "target_acc", "final_loss", "history", **last evaluation}.
    """
    rng = random.Random(seed)
    order: list[int] = []
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = (torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / lr_warmup_steps))
             if lr_warmup_steps else None)
    history: list[dict[str, float]] = []
    ev: dict[str, float] = {"accuracy": 0.0}
    step, loss_val = 0, float("nan")
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.train()
        while step < max_steps:
            if len(order) < batch_size:
                more = list(range(len(examples)))
                rng.shuffle(more)
                order.extend(more)
            idx, order = order[:batch_size], order[batch_size:]
            width = max(len(examples[i][0]) for i in idx)
            ids = torch.full((len(idx), width), pad_token_id, dtype=torch.long)
            labels = torch.full((len(idx), width), -100, dtype=torch.long)
            att = torch.zeros((len(idx), width), dtype=torch.long)
            for row, i in enumerate(idx):
                seq, m = examples[i]
                t = torch.as_tensor(seq)
                ids[row, : len(seq)] = t
                labels[row, : len(seq)] = torch.where(torch.as_tensor(m, dtype=torch.bool), t, torch.tensor(-100))
                att[row, : len(seq)] = 1
            out = model(input_ids=ids.to(device), attention_mask=att.to(device), labels=labels.to(device))
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if sched is not None:
                sched.step()
            step += 1
            loss_val = float(out.loss.detach())
            if step % eval_every == 0 or step == max_steps:
                ev = evaluate()
                history.append({"step": step, "loss": loss_val, **ev})
                logger.info("%s step %d loss %.3f %s", log_name, step, loss_val,
                            " ".join(f"{k} {v:.3f}" for k, v in ev.items()))
                model.train()
                if ev["accuracy"] >= target_acc:
                    break
    model.eval()
    return {"steps": step, "seconds": time.perf_counter() - t0, **ev, "reached_target": ev["accuracy"] >= target_acc,
            "target_acc": target_acc, "final_loss": loss_val, "history": history}


def warm_model_settings(**kw: Any) -> dict[str, Any]:
    return {"format": WARMUP_FORMAT, **kw}


def get_warm_model(
    cache_dir: str,
    *,
    seed: int = 0,
    target_acc: float = 0.30,
    max_steps: int = 400,
    batch_size: int = 64,
    lr: float = 1e-3,
    eval_every: int = 25,
    max_operand: int = 49,
    test_size: int = 200,
    data_seed: int = 0,
    model_kwargs: Optional[dict[str, Any]] = None,
    num_threads: Optional[int] = None,
) -> str:
    """Path of a warmed-up tiny model folder (HF format, loadable with `load_model_dir`).

    The folder is `cache_dir/tiny-<hash of the settings>/`. It is built in a temporary folder, a marker file is
    written last and the folder renamed into place, under a file lock, so a crashed or concurrent build is never
    reused half-done. `warmup.json` in the folder records the settings and the reached accuracy. The held-out
    split is `make_arith_splits(max_operand, test_size, seed=data_seed)[1]` (the same the experiments evaluate on).
    """
    from arl.data.arith import make_arith_splits
    from arl.models.tiny import CHARS, build_char_tokenizer, build_tiny_model, save_model_dir

    settings = warm_model_settings(
        seed=seed, target_acc=target_acc, max_steps=max_steps, batch_size=batch_size, lr=lr,
        eval_every=eval_every, max_operand=max_operand, test_size=test_size, data_seed=data_seed,
        model_kwargs=dict(sorted((model_kwargs or {}).items())), chars=CHARS,
    )

    def build(tmp: str) -> dict:
        old_threads = torch.get_num_threads()
        if num_threads:
            torch.set_num_threads(num_threads)
        try:
            train, test = make_arith_splits(max_operand=max_operand, test_size=test_size, seed=data_seed)
            tok = build_char_tokenizer()
            model = build_tiny_model(len(tok), seed=seed, pad_token_id=tok.pad_token_id,
                                     eos_token_id=tok.eos_token_id, **(model_kwargs or {}))
            logger.info("warming up the tiny model into %s", cache_dir)
            result = warmup_sft(model, tok, train, target_acc=target_acc, max_steps=max_steps,
                                batch_size=batch_size, lr=lr, eval_rows=test, seed=seed, eval_every=eval_every)
            if not result["reached_target"]:
                logger.warning("tiny-model warm-up stopped at %d steps with greedy accuracy %.3f < target %.3f",
                               result["steps"], result["accuracy"], target_acc)
            save_model_dir(model, tok, tmp)
            return {"num_params": sum(p.numel() for p in model.parameters()), **result}
        finally:
            if num_threads:
                torch.set_num_threads(old_threads)

    return cached_model_dir(cache_dir, "tiny", settings, build)


def cached_model_dir(cache_dir: str, prefix: str, settings: dict[str, Any], build: Callable[[str], dict]) -> str:
    """`cache_dir/<prefix>-<hash of settings>`, built once by `build(tmp_dir) -> info` under a file lock, written
    to a temporary folder and renamed into place after a marker file (a crashed build is never reused)."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    cache_dir = os.path.abspath(os.path.expanduser(cache_dir))
    final = os.path.join(cache_dir, f"{prefix}-{digest}")
    if os.path.exists(os.path.join(final, MARKER)):
        return final
    os.makedirs(cache_dir, exist_ok=True)
    with open(os.path.join(cache_dir, f"{prefix}-{digest}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(os.path.join(final, MARKER)):
            return final
        tmp = f"{final}.tmp-{os.getpid()}"
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            info = build(tmp)
            with open(os.path.join(tmp, INFO_FILE), "w") as f:
                json.dump({"settings": settings, **info}, f, indent=2)
            with open(os.path.join(tmp, MARKER), "w") as f:
                f.write("ok\n")
            if os.path.exists(final):
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final

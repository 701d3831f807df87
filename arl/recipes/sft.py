"""What the warm-up recipes share: masked SFT on token ids, batched greedy decoding, and the model cache."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import random
import shutil
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

logger = logging.getLogger(__name__)

MARKER = "WARMUP_COMPLETE"
INFO_FILE = "warmup.json"


@torch.no_grad()
def greedy_generate(
    model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_token_id: int, pad_token_id: int
) -> list[list[int]]:
    """Batched greedy decoding with plain HF forward calls (left padding, KV cache). Each output stops after
    (and includes) its first eos."""
    if not prompts:
        return []
    from arl.inference.torch_engine import left_pad

    device = next(model.parameters()).device
    ids, mask, pos = left_pad(prompts, pad_token_id, device)  # the prefill, then one new token per row
    past = None
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    gen: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_new_tokens):
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=past, use_cache=True)
        past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1)
        for i in range(len(prompts)):
            if not done[i]:
                gen[i].append(int(nxt[i]))
        done |= nxt == eos_token_id
        if bool(done.all()):
            break
        ids, pos = nxt[:, None], pos[:, -1:] + 1
        mask = torch.cat([mask, torch.ones((len(prompts), 1), dtype=mask.dtype, device=device)], dim=1)
    return gen


def masked_sft(model: Any, examples: Sequence[tuple[list[int], list[int]]], pad_token_id: int,
               evaluate: Callable[[], dict[str, float]], *, target_acc: float, max_steps: int, batch_size: int,
               lr: float, eval_every: int, seed: int, lr_warmup_steps: int = 0,
               log_name: str = "warm-up") -> dict[str, Any]:
    """The warm-up loop both tiny-model recipes share: shuffled passes over `examples` (token ids, loss mask),
    AdamW with gradient clipping (and an optional linear LR warm-up), `evaluate()` (in eval mode) every `eval_every`
    steps until its "accuracy" reaches `target_acc` or `max_steps` is reached.

    Returns {"steps", "seconds", "reached_target", "target_acc", "final_loss", "history", **last evaluation}.
    """
    rng = random.Random(seed)
    order: list[int] = []
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / lr_warmup_steps) if lr_warmup_steps
                                              else 1.0)
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
            seqs = [torch.as_tensor(examples[i][0], dtype=torch.long) for i in idx]  # right-padded below
            ids = pad_sequence(seqs, batch_first=True, padding_value=pad_token_id)
            labels = pad_sequence([torch.where(torch.as_tensor(examples[i][1], dtype=torch.bool), t, -100)
                                   for i, t in zip(idx, seqs)], batch_first=True, padding_value=-100)
            att = pad_sequence([torch.ones_like(t) for t in seqs], batch_first=True)
            out = model(input_ids=ids.to(device), attention_mask=att.to(device), labels=labels.to(device))
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            loss_val = float(out.loss.detach())
            if step % eval_every == 0 or step == max_steps:
                model.eval()
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


@contextlib.contextmanager
def torch_threads(num_threads: Optional[int]) -> Iterator[None]:
    """Build with `num_threads` torch threads (None/0: leave them), restoring the caller's count afterwards."""
    old = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def warm_model_dir(cache_dir: str, prefix: str, settings: dict[str, Any], what: str,
                   train: Callable[[Any, Any], dict[str, Any]], *, seed: int, extra_chars: str = "",
                   model_kwargs: Optional[dict[str, Any]] = None, num_threads: Optional[int] = None) -> str:
    """The cached folder (`cached_model_dir`) of a tiny model (char tokenizer with `extra_chars`, `build_tiny_model`
    with `seed` and `model_kwargs`) warmed up by `train(model, tokenizer)` -> `masked_sft`'s result, which
    `warmup.json` records (a warning when it stopped short of its target)."""
    from arl.models.tiny import build_char_tokenizer, build_tiny_model, save_model_dir

    def build(tmp: str) -> dict:
        with torch_threads(num_threads):
            tok = build_char_tokenizer(extra_chars)
            model = build_tiny_model(len(tok), seed=seed, pad_token_id=tok.pad_token_id,
                                     eos_token_id=tok.eos_token_id, **(model_kwargs or {}))
            logger.info("warming up the %s into %s", what, tmp)
            result = train(model, tok)
            if not result["reached_target"]:
                logger.warning("%s warm-up stopped at %d steps with greedy accuracy %.3f < target %.3f", what,
                               result["steps"], result["accuracy"], result["target_acc"])
            save_model_dir(model, tok, tmp)
            return {"num_params": sum(p.numel() for p in model.parameters()), **result}

    return cached_model_dir(cache_dir, prefix, settings, build)


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

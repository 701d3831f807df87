"""Train a tiny Llama on fixed trajectories; run by the resume and multi-rank tests as a separate process.

    python tests/learner/_train_fixed.py --out W.safetensors --steps 4                       # straight
    python tests/learner/_train_fixed.py --out W --steps 4 --ckpt D --checkpoint-every 2 --hang-after 2
    python tests/learner/_train_fixed.py --out W --steps 4 --ckpt D --resume                  # recover=auto
    torchrun --nproc_per_node 2 tests/learner/_train_fixed.py --out W --steps 3 --ranks       # 2 ranks (gloo)

Single-rank mode goes through `LearnerWorker` (the learner role's loop: FIFO batches, checkpoints, resume).
``--ranks`` mode runs `PPOActor.step` (on a `DeepSpeedEngine`) on each rank with its share of every batch: whole groups,
group ``i`` of a batch to rank ``i % world``. Every rank writes its final weights to ``<out>.rank<r>``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from arl.api.types import Trajectory  # noqa: E402

VOCAB = 32
BATCH = 4  # groups per step
GROUP = 3  # trajectories per group


def make_groups(n: int, seed: int = 0) -> list[list[Trajectory]]:
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(n):
        prompt = rng.integers(1, VOCAB, size=int(rng.integers(2, 6)))
        group = []
        for k in range(GROUP):
            gen = rng.integers(1, VOCAB, size=int(rng.integers(1, 9)))
            ids = np.concatenate([prompt, gen])
            mask = np.r_[np.zeros(len(prompt)), np.ones(len(gen))]
            lp = np.where(mask > 0, -np.log(VOCAB) + rng.normal(0, 0.3, len(ids)), 0.0)
            ver = np.where(mask > 0, 0, -1)
            group.append(Trajectory(ids, mask, lp, ver, float(rng.integers(0, 2)) + 0.1 * k, f"g{g}",
                                    metadata={"prompt_pos": [0, g]}))
        groups.append(group)
    return groups


def make_learner(args: argparse.Namespace):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.learner._build import make_actor

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                         pad_token_id=0))
    # --lora-rank r: LoRA adapters on q/k/v/o (at 1e-3 x learner.lora.lr_scale 10, so they move visibly in a few steps)
    rank = int(getattr(args, "lora_rank", 0) or 0)
    return make_actor(model, lr=1e-3, seed=0, zero_stage=args.zero_stage, lr_schedule="cosine",
                      warmup_steps=1, total_steps=args.steps, max_tokens_per_mb=args.max_tokens_per_mb, rank=rank)


def save(lrn, path: str) -> None:
    from safetensors.torch import save_file

    sd = {k: v.detach().cpu().contiguous().clone() for k, v in lrn.engine.module.state_dict().items()}
    save_file(sd, path)


async def run_worker(args: argparse.Namespace) -> None:
    from arl.learner.worker import LearnerWorker
    from tests.typed_control import typed

    lrn = make_learner(args)

    async def send(msg_type: str, payload: dict) -> None:
        pass

    worker = LearnerWorker(actor=lrn, pull=None, send_control=typed(send), batch_size=BATCH, total_steps=args.steps,
                           weights_dir=os.path.join(os.path.dirname(os.path.abspath(args.out)), "weights"),
                           checkpoint_dir=args.ckpt, checkpoint_every=args.checkpoint_every)
    groups = make_groups(BATCH * args.steps)
    if args.resume:
        v = await worker.resume()
        print(f"resumed at version {v}, {worker.groups_consumed} groups consumed, position {worker.data_position}",
              flush=True)
    # the prompt stream resumes at the recorded data position (these groups are trained in order: no gaps)
    done = worker.data_position.get("0")
    assert done is None or not done.above, done
    worker.buffer.extend(groups[done.low if done is not None else 0:])
    if args.hang_after:
        worker.total_steps = args.hang_after
        await worker.train()
        save(lrn, args.out)
        open(args.out + ".ready", "w").close()
        time.sleep(3600)  # the test kills this process here
    await worker.train()
    save(lrn, args.out)


def run_ranks(args: argparse.Namespace) -> None:
    lrn = make_learner(args)
    groups = make_groups(BATCH * args.steps)
    rank, world = lrn.engine.rank, lrn.engine.world_size
    for step in range(args.steps):
        batch_groups = groups[step * BATCH:(step + 1) * BATCH]
        mine = [t for i, g in enumerate(batch_groups) if i % world == rank for t in g]
        m = lrn.step(mine)
        print(f"rank {rank} step {step + 1}: loss {m['loss']:.6f} grad_norm {m['grad_norm']:.6f} "
              f"n_seqs {m['n_seqs']:.0f} n_tokens {m['n_tokens']:.0f}", flush=True)
    lrn.engine.export_weights(args.out + ".full")  # collective (ZeRO-3 gathers); rank 0 writes
    if args.zero_stage < 3:
        save(lrn, f"{args.out}.rank{rank}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--checkpoint-every", type=int, default=0)
    ap.add_argument("--hang-after", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--ranks", action="store_true")
    ap.add_argument("--zero-stage", type=int, default=0)
    ap.add_argument("--max-tokens-per-mb", type=int, default=40)
    ap.add_argument("--lora-rank", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.ranks:
        run_ranks(args)
    else:
        asyncio.run(run_worker(args))


if __name__ == "__main__":
    main()

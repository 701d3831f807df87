"""A torch receiver in its own process, for the broadcast tests: joins a group, receives `--versions` transfers
into a `TinyNet` (zeroed first) and saves the model's state dict after each as ``<out>/v<version>.pt``; on an error
it writes the message to ``<out>/error.txt`` and exits 2.

    python -m tests.weights.receiver_proc --spec JSON --out DIR [--versions N] [--die-at-bucket K]
        [--wrong-shape] [--reverse-order] [--fresh]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from arl.weights.group import GroupSpec, WeightTransferError
from arl.weights.receiver import WeightReceiver


class TinyNet(torch.nn.Module):
    """Float32 and bfloat16 parameters, an int64 buffer and tied embeddings: what a real state dict holds."""

    def __init__(self, hidden: int = 16, vocab: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.norm = torch.nn.Linear(hidden, hidden).to(torch.bfloat16)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--versions", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--die-at-bucket", type=int, default=-1)
    ap.add_argument("--wrong-shape", action="store_true")
    ap.add_argument("--reverse-order", action="store_true")
    ap.add_argument("--fresh", action="store_true", help="receive() new tensors instead of in place")
    a = ap.parse_args()
    torch.set_num_threads(1)
    model = TinyNet(hidden=8 if a.wrong_shape else 16)
    with torch.no_grad():
        for t in model.state_dict().values():
            t.zero_()
    os.makedirs(a.out, exist_ok=True)

    def progress(k: int, n: int) -> None:
        if k == a.die_at_bucket:
            os._exit(3)  # dies in the middle of a transfer, as a killed worker would

    rx = WeightReceiver(GroupSpec.from_dict(json.loads(a.spec)), timeout_s=a.timeout, gloo_host="127.0.0.1")
    try:
        rx.join()
        names = list(model.state_dict())
        expected = names[::-1] if a.reverse_order else None
        for _ in range(a.versions):
            if a.fresh:
                v, new = rx.receive(model, expected_names=expected, progress=progress)
                sd = model.state_dict()
                with torch.no_grad():
                    for n, t in new.items():
                        sd[n].copy_(t)
            else:
                v = rx.receive_into(model, expected_names=expected, progress=progress)
            torch.save(model.state_dict(), os.path.join(a.out, f"v{v}.pt"))
    except WeightTransferError as e:
        with open(os.path.join(a.out, "error.txt"), "w") as f:
            f.write(str(e))
        return 2
    finally:
        rx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The broadcast weight transport: a sender in this process, torch receivers in their own processes, over gloo on
127.0.0.1 (the sender's store and every group on a port the OS picked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional

import pytest
import torch

from arl.weights.group import GroupSpec, WeightTransferError
from arl.weights.plan import TransferPlan, dedup_tied, make_plan, pack_bucket, unpack_bucket
from arl.weights.receiver import WeightReceiver, check_plan
from arl.weights.sender import WeightSender
from tests.weights.receiver_proc import TinyNet

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 30.0


def learner_state(seed: int) -> dict[str, torch.Tensor]:
    """A TinyNet state dict with random values (the learner's weights at some version)."""
    torch.manual_seed(seed)
    m = TinyNet()
    with torch.no_grad():
        for t in m.state_dict().values():
            if t.is_floating_point():
                t.copy_(torch.randn_like(t, dtype=torch.float32).to(t.dtype))
            else:
                t.copy_(torch.randint(0, 1000, t.shape))
    return {k: v.clone() for k, v in m.state_dict().items()}


class Receiver:
    """A receiver process (tests/weights/receiver_proc.py) and what it saved."""

    def __init__(self, spec: GroupSpec, out: Path, *args: str) -> None:
        self.out = out
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.weights.receiver_proc", "--spec",
                                      json.dumps(spec.to_dict()), "--out", str(out), "--timeout", str(TIMEOUT),
                                      *args], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def wait(self) -> tuple[int, str]:
        out, _ = self.proc.communicate(timeout=120)
        return self.proc.returncode, out.decode(errors="replace")

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        return torch.load(self.out / f"v{version}.pt")

    def error(self) -> str:
        return (self.out / "error.txt").read_text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


def open_groups(sender: WeightSender, groups: dict[str, int]) -> None:
    """Open groups (name -> world size) while their receivers join; fails the test if one does not form."""
    for name, world in groups.items():
        sender.open_group(name, world)


@pytest.fixture
def sender():
    s = WeightSender("127.0.0.1", 0, timeout_s=TIMEOUT, gloo_host="127.0.0.1")
    yield s
    s.close()


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


# ------------------------------------------------------------------------------------------------- plan, no network

def test_plan_buckets_split_on_size_and_alignment() -> None:
    sd = {"a": torch.zeros(3, dtype=torch.int8), "b": torch.zeros(2, dtype=torch.float32),
          "c": torch.zeros(100), "d": torch.zeros(1, dtype=torch.float16)}
    plan = make_plan(sd, bucket_bytes=64)
    # "b" would start at byte 3, not a multiple of 4: new bucket; "c" (400 B) is over the size: alone
    assert plan.buckets == ((0, 1), (1, 2), (2, 3), (3, 4))
    assert make_plan(sd, names=["c", "d", "b"], bucket_bytes=1 << 20).buckets == ((0, 2), (2, 3))
    assert TransferPlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    with pytest.raises(ValueError, match="cover"):
        TransferPlan.from_json({"tensors": plan.to_json()["tensors"], "buckets": [[0, 2]]})


def test_pack_unpack_round_trip_in_wire_dtype() -> None:
    sd = learner_state(1)
    plan = make_plan(sd, wire_dtype="bfloat16", bucket_bytes=300)
    assert {t.dtype for t in plan.tensors} == {"bfloat16", "int64"}
    got = {}
    for k in range(len(plan.buckets)):
        buf = pack_bucket(plan, k, sd)
        assert buf.numel() == plan.bucket_nbytes(k)
        got.update(unpack_bucket(plan, k, buf))
    for n, t in sd.items():
        assert torch.equal(got[n], t.to(torch.bfloat16) if t.is_floating_point() else t), n


def test_sglang_requests_carry_version_and_flush_on_the_last_bucket_only() -> None:
    plan = make_plan(learner_state(0), wire_dtype="float16", bucket_bytes=1200)
    reqs = plan.sglang_requests("g", "7")
    assert len(reqs) == len(plan.buckets) > 1
    assert [r["names"] for r in reqs] == [[t.name for t in plan.bucket(k)] for k in range(len(reqs))]
    assert all(r["load_format"] == "flattened_bucket" and r["group_name"] == "g" for r in reqs)
    assert [("weight_version" in r, r["flush_cache"]) for r in reqs] == [(False, False)] * (len(reqs) - 1) + [(True, True)]


def test_check_plan_names_what_does_not_fit() -> None:
    model = TinyNet()
    target = model.state_dict(keep_vars=True)
    sd = dedup_tied(TinyNet().state_dict())
    assert "head.weight" not in sd and "embed.weight" in sd  # tied to embed.weight: sent once
    assert check_plan(make_plan(sd), target) is None  # the tied alias is not "missing"
    assert "shape [32, 16] sent, [32, 8] here" in check_plan(make_plan(sd), TinyNet(hidden=8).state_dict())
    names = list(sd)
    msg = check_plan(make_plan(sd), target, expected_names=names[::-1])
    assert f"order differs at tensor #0: sender sends {names[0]!r}, receiver expects {names[-1]!r}" in msg
    msg = check_plan(make_plan({k: v for k, v in sd.items() if k != "proj.bias"}), target)
    assert "missing ['proj.bias']" in msg
    assert "dtype float32 sent, int64 here" in check_plan(make_plan({"steps": torch.zeros(3)}), target,
                                                          allow_missing=True)


# ---------------------------------------------------------------------------------------------- over gloo, in-process

def test_waits_time_out_with_a_clear_error() -> None:
    s = WeightSender("127.0.0.1", 0, timeout_s=1.0, gloo_host="127.0.0.1")
    try:
        with pytest.raises(WeightTransferError, match="could not form the group within 1s"):
            s.open_group("nobody-joins")
        rx = WeightReceiver(s.spec("g"), timeout_s=TIMEOUT, gloo_host="127.0.0.1")
        t = threading.Thread(target=rx.join)
        t.start()
        s.open_group("g")
        t.join()
        with pytest.raises(WeightTransferError, match="no transfer #0 announced within 0.2s"):
            rx.receive_into(TinyNet(), wait_s=0.2)
        rx.close()
    finally:
        s.close()


def test_default_process_group_is_untouched(tmp_path: Path) -> None:
    """A learner's default (DeepSpeed) group exists before the sender: it keeps its size, its collectives work,
    torch's registry of groups is unchanged, and the weights still arrive."""
    script = r"""
import threading, torch, torch.distributed as dist
from torch.distributed.distributed_c10d import _world
from arl.utils.net import free_port
from arl.weights.receiver import WeightReceiver
from arl.weights.sender import WeightSender
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
before = dict(_world.pg_names)
s = WeightSender(timeout_s=30, gloo_host="127.0.0.1")
rx = WeightReceiver(s.spec("g"), timeout_s=30, gloo_host="127.0.0.1")
t = threading.Thread(target=rx.join); t.start(); s.open_group("g"); t.join()
sd = {"w": torch.randn(5, 3)}
got = {}
t = threading.Thread(target=lambda: got.update(rx.receive()[1])); t.start(); s.send(1, sd); t.join()
x = torch.ones(2); dist.all_reduce(x)
assert torch.equal(got["w"], sd["w"]) and dist.get_world_size() == 1 and torch.equal(x, torch.ones(2))
assert dict(_world.pg_names) == before, (_world.pg_names, before)
rx.close(); s.close(); dist.destroy_process_group(); print("OK")
"""
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


# -------------------------------------------------------------------------------------- receivers in other processes

@pytest.mark.parametrize("fresh", [False, True], ids=["in_place", "new_tensors"])
def test_one_receiver_gets_every_version_bit_for_bit(sender: WeightSender, tmp_path: Path, fresh: bool) -> None:
    rx = Receiver(sender.spec("w0"), tmp_path / "w0", "--versions", "2", *(["--fresh"] if fresh else []))
    try:
        open_groups(sender, {"w0": 2})
        v1, v2 = learner_state(1), learner_state(2)
        stats = sender.send(1, v1, plan=make_plan(v1, bucket_bytes=512))  # several buckets
        assert stats.groups == ["w0"] and stats.bytes == make_plan(v1).total_bytes
        sender.send(2, v2)
        code, out = rx.wait()
        assert code == 0, out
        assert_same(rx.weights(1), v1)
        assert_same(rx.weights(2), v2)
    finally:
        rx.kill()


def test_three_receivers_shared_group_and_wire_dtype(sender: WeightSender, tmp_path: Path) -> None:
    """One group of rank 0 + 3 receivers; floats travel in bfloat16 and come back as each parameter's dtype."""
    rxs = [Receiver(sender.spec("all", world_size=4, rank=r), tmp_path / f"r{r}") for r in (1, 2, 3)]
    try:
        open_groups(sender, {"all": 4})
        sd = learner_state(3)
        sender.send(5, sd, plan=make_plan(sd, wire_dtype=torch.bfloat16, bucket_bytes=700))
        want = {k: (v.to(torch.bfloat16).to(v.dtype) if v.is_floating_point() else v) for k, v in sd.items()}
        for rx in rxs:
            code, out = rx.wait()
            assert code == 0, out
            assert_same(rx.weights(5), want)
    finally:
        for rx in rxs:
            rx.kill()


def test_per_receiver_groups_mismatch_is_refused_before_any_byte(sender: WeightSender, tmp_path: Path) -> None:
    """Three groups of one receiver each: one model has other shapes, one expects another order. Both refuse with
    the reason, the sender's error names both groups and reasons, and the third receiver gets the weights."""
    good = Receiver(sender.spec("good"), tmp_path / "good")
    shape = Receiver(sender.spec("shape"), tmp_path / "shape", "--wrong-shape")
    order = Receiver(sender.spec("order"), tmp_path / "order", "--reverse-order")
    try:
        open_groups(sender, {"good": 2, "shape": 2, "order": 2})
        sd = learner_state(4)
        with pytest.raises(WeightTransferError) as e:
            sender.send(1, sd)
        assert set(e.value.failures) == {"shape", "order"} and e.value.ok == ["good"]
        assert "rank 1: embed.weight: shape [32, 16] sent, [32, 8] here" in e.value.failures["shape"]
        names = list(sd)
        assert f"order differs at tensor #0: sender sends {names[0]!r}, receiver expects {names[-1]!r}" in \
            e.value.failures["order"]
        assert sorted(sender.groups) == ["good", "order", "shape"]  # a refusal leaves the group usable
        assert good.wait()[0] == 0
        assert_same(good.weights(1), sd)
        for rx in (shape, order):
            code, out = rx.wait()
            assert code == 2, out
            assert "refused v1" in rx.error()
        assert "embed.weight: shape [32, 16] sent, [32, 8] here" in shape.error()
    finally:
        for rx in (good, shape, order):
            rx.kill()


def test_receiver_dying_mid_transfer_fails_its_group_only(sender: WeightSender, tmp_path: Path) -> None:
    dying = Receiver(sender.spec("dying"), tmp_path / "dying", "--die-at-bucket", "1")
    alive = Receiver(sender.spec("alive"), tmp_path / "alive")
    try:
        open_groups(sender, {"dying": 2, "alive": 2})
        sd = learner_state(5)
        with pytest.raises(WeightTransferError) as e:
            sender.send(1, sd, plan=make_plan(sd, bucket_bytes=256))
        assert list(e.value.failures) == ["dying"] and e.value.ok == ["alive"]
        assert "group 'dying' rank 0:" in e.value.failures["dying"]
        assert "of v1 failed or timed out" in e.value.failures["dying"]
        assert sender.groups == ["alive"]  # the broken group is closed
        assert dying.wait()[0] == 3
        assert alive.wait()[0] == 0
        assert_same(alive.weights(1), sd)
    finally:
        dying.kill()
        alive.kill()


def test_a_receiver_that_joins_later_gets_the_newest_version(sender: WeightSender, tmp_path: Path) -> None:
    """Worker 0 gets v1; worker 1 starts later on its own group and gets the newest version (v1) alone; then v2
    reaches both; worker 0 restarts on a fresh group name and gets v2, the newest."""
    w0 = Receiver(sender.spec("w0"), tmp_path / "w0", "--versions", "2")
    w1: Optional[Receiver] = None
    w0b: Optional[Receiver] = None
    try:
        open_groups(sender, {"w0": 2})
        v1, v2 = learner_state(1), learner_state(2)
        sender.send(1, v1)
        w1 = Receiver(sender.spec("w1"), tmp_path / "w1", "--versions", "2")
        open_groups(sender, {"w1": 2})
        sender.send(1, v1, groups=["w1"])  # catch-up: the newest weights, to the newcomer only
        sender.send(2, v2)
        assert w0.wait()[0] == 0 and w1.wait()[0] == 0
        for rx in (w0, w1):
            assert_same(rx.weights(1), v1)
            assert_same(rx.weights(2), v2)
        sender.close_group("w0")  # worker 0 restarts: a new process, a new group name on the same store
        w0b = Receiver(sender.spec("w0-r1"), tmp_path / "w0b")
        open_groups(sender, {"w0-r1": 2})
        sender.send(2, v2, groups=["w0-r1"])
        assert w0b.wait()[0] == 0
        assert_same(w0b.weights(2), v2)
        assert not (tmp_path / "w0b" / "v1.pt").exists()
    finally:
        for rx in (w0, w1, w0b):
            if rx is not None:
                rx.kill()

"""A learner restarted after its predecessor was lost (`LearnerWorker.resume_after_loss`): it resumes from the
newest checkpoint (or starts over at version 0, exported too), says which for the controller's rollback, leaves
the groups the checkpoint had buffered (lost with the old process) out of its counts, and takes again a group
received only after the checkpoint."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from arl.api.types import Trajectory
from arl.learner.worker import LearnerWorker

from ..typed_control import typed
from .test_replayed_groups import FakePull, drain


def group(gid: str, pos: int) -> list[Trajectory]:
    return [Trajectory(input_ids=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1], logprobs=[0, 0, -1.0, -1.0],
                       versions=[-1, -1, 0, 0], reward=float(j), group_id=f"{gid}:{j}",
                       metadata={"prompt_pos": [0, pos]}) for j in range(2)]


class CheckpointEngine:
    """Saves and loads `arl_state.json` in DeepSpeed's layout (`latest` names the tag) and exports files."""

    def __init__(self) -> None:
        self.version = 0

    def save(self, path: str, state: dict, keep: int) -> str:
        d = os.path.join(path, f"v{self.version}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "arl_state.json"), "w") as f:
            json.dump({"version": self.version, **state}, f)
        with open(os.path.join(path, "latest"), "w") as f:
            f.write(f"v{self.version}")
        return d

    def load(self, path: str) -> dict:
        with open(os.path.join(path, open(os.path.join(path, "latest")).read(), "arl_state.json")) as f:
            state = json.load(f)
        self.version = state["version"]
        return state

    def export_weights(self, path: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "w").write(f"v{self.version}")


def learner(tmp_path, frames: list) -> tuple[LearnerWorker, list]:
    sent: list = []

    async def send(t: str, p: dict) -> None:
        sent.append((t, p))

    engine = CheckpointEngine()
    w = LearnerWorker(actor=SimpleNamespace(engine=engine), pull=FakePull(frames), send_control=typed(send),
                      batch_size=2, total_steps=4, weights_dir=str(tmp_path / "weights"),
                      checkpoint_dir=str(tmp_path / "checkpoints"), checkpoint_every=1)
    return w, sent


@pytest.mark.asyncio
async def test_a_restarted_learner_resumes_from_the_checkpoint_and_says_where(tmp_path):
    w, _ = learner(tmp_path, [("traj", group(f"w0.aag{i}", i)) for i in range(3)])
    await drain(w)
    w._count_trained(await w.next_batch())  # trains g0, g1; g2 stays buffered
    w.engine.version = 1
    await w.maybe_checkpoint()
    # the successor: v1, 2 groups settled (g2, buffered in the checkpoint, is gone with the old process)
    w2, sent = learner(tmp_path, [("traj", group("w0.aag3", 3)), ("traj", group("w0.aag2", 2))])
    state = await w2.resume_after_loss()
    assert state.pop("path").endswith("v1.safetensors")  # where the weights it starts from are (a policy's learner)
    assert state == {"version": 1, "groups_consumed": 2, "data_position": {"0": {"low": 2, "above": []}},
                     "groups_settled": 2, "trajectories_settled": 4}
    assert w2.stats["groups_received"] == 2 and w2.stats["trajectories_received"] == 4
    assert open(tmp_path / "weights" / "v1.safetensors").read() == "v1"  # the servers go back to these
    await drain(w2)  # g3, received only after the checkpoint, is taken; g2 was in the checkpoint's ids
    assert [g[0].group_id for g in w2.buffer] == ["w0.aag3:0"] and w2.stats["replayed_groups"] == 1
    assert sent == [("group_received", {"group_id": "w0.aag3", "n_traj": 2})]


@pytest.mark.asyncio
async def test_without_a_checkpoint_a_restarted_learner_starts_over_at_version_0_and_exports_it(tmp_path):
    w, _ = learner(tmp_path, [])
    state = await w.resume_after_loss()
    assert state.pop("path").endswith("v0.safetensors")
    assert state == {"version": 0, "groups_consumed": 0, "data_position": {}, "groups_settled": 0,
                     "trajectories_settled": 0}
    assert open(tmp_path / "weights" / "v0.safetensors").read() == "v0"

"""Several policies in one trajectory: each learner trains only the tokens its policy generated, with its own reward
(`policy_view`, `PPOActor(policy=...)`), and the run's own policy is untouched by it."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from arl.api.types import SampleOutput, Trajectory, TrajectoryBuilder
from arl.learner.actor import policy_view

pytest.importorskip("deepspeed")

from tests.learner._build import make_actor  # noqa: E402
from tests.learner.test_learner_features import on_policy, tiny  # noqa: E402


def game(moves_white, moves_black, white_reward, gid, prompt=(1, 2)) -> Trajectory:
    """A two-player game in one token sequence: white's and black's moves alternate after the prompt, each a
    sample of its policy (the builder records the spans)."""
    b = TrajectoryBuilder(list(prompt))
    for w, k in zip(moves_white, moves_black):
        for ids, who in ((w, "white"), (k, "black")):
            n = len(ids)
            b.add_generated(SampleOutput(np.array(ids), np.full(n, -2.0), np.full(n, 3 if who == "white" else 7),
                                         "stop"), policy=who)
            b.add_context([4])  # the board after the move
    return b.build(0.0, gid, policy_rewards={"white": white_reward, "black": -white_reward})


def test_the_builder_records_who_generated_what():
    t = game([[5, 6]], [[7]], 1.0, "g")
    assert t.policy_spans == [("white", 2, 4), ("black", 5, 6)]
    assert t.owned_by("white").tolist() == [0, 0, 1, 1, 0, 0, 0]
    assert t.owned_by("black").tolist() == [0, 0, 0, 0, 0, 1, 0]
    assert not t.owned_by(None).any()  # every generated token belongs to a named policy
    assert (t.reward_of("white"), t.reward_of("black"), t.reward_of(None), t.reward_of("other")) == (1.0, -1.0, 0.0,
                                                                                                       0.0)
    plain = TrajectoryBuilder([1])
    plain.add_generated(SampleOutput(np.array([3]), np.zeros(1), np.zeros(1), "stop"))
    assert plain.build(1.0, "p").policy_spans == []  # one policy: as before


@pytest.mark.parametrize("spans, why", [
    ([("white", 0, 9)], "outside"), ([("white", 2, 2)], "empty"), ([("a", 1, 3), ("b", 2, 4)], "overlaps"),
    ([("", 0, 1)], "non-empty name"), ([("a", 0.5, 1)], "integers"), ("white", "a list"),
])
def test_bad_spans_are_refused_by_name(spans, why):
    with pytest.raises(ValueError, match=why):
        Trajectory([1, 2, 3, 4], [0, 1, 1, 1], [0, -1, -1, -1], [-1, 0, 0, 0], 0.0, "g", policy_spans=spans)
    with pytest.raises(ValueError, match="policy_rewards"):
        Trajectory([1, 2], [0, 1], [0, -1], [-1, 0], 0.0, "g", policy_rewards={"a": "win"})


def test_each_policy_sees_its_own_tokens_versions_and_reward():
    batch = [game([[5, 6]], [[7]], 1.0, "g"), game([[5]], [[8, 9]], -1.0, "g")]
    white = policy_view(batch, "white")
    assert [t.loss_mask.tolist() for t in white] == [t.owned_by("white").astype(int).tolist() for t in batch]
    assert [t.reward for t in white] == [1.0, -1.0] and [t.reward for t in policy_view(batch, "black")] == [-1.0, 1.0]
    for t in white:  # the other policy's tokens are context now: no logprob, no version
        ctx = ~t.loss_mask.astype(bool)
        assert (t.versions[ctx] == -1).all() and (t.logprobs[ctx] == 0).all() and (t.versions[~ctx] == 3).all()
    assert policy_view(batch, None) == [] and policy_view(batch, "nobody") == []
    plain = Trajectory([1, 2, 3], [0, 1, 1], [0, -1, -1], [-1, 2, 2], 0.5, "p")
    assert policy_view([plain], None)[0] is plain and policy_view([plain], "white") == []


def test_the_learner_of_one_policy_trains_as_if_the_others_turns_were_context():
    """One step of `PPOActor(policy="white")` on games of both players moves the weights exactly as the run's own
    policy's step on the same games written with black's moves as context and white's rewards."""
    base = tiny(3)
    games = [game([[5, 6], [9]], [[7], [8, 8]], 1.0, "a"), game([[6], [5]], [[9, 9], [7]], -1.0, "a"),
             game([[8]], [[5, 5]], 1.0, "b"), game([[9, 9]], [[6]], -1.0, "b")]
    games = on_policy(base, games)
    by_hand = [Trajectory(t.input_ids, t.owned_by("white"), np.where(t.owned_by("white"), t.logprobs, 0.0),
                          np.where(t.owned_by("white"), t.versions, -1), t.reward_of("white"), t.group_id)
               for t in games]
    white = make_actor(copy.deepcopy(base), lr=1e-2, version=3)
    white.policy = "white"
    plain = make_actor(copy.deepcopy(base), lr=1e-2, version=3)
    m_white, m_plain = white.step(games), plain.step(by_hand)
    assert m_white["n_tokens"] == m_plain["n_tokens"] == sum(int(t.owned_by("white")[1:].sum()) for t in games)
    assert m_white["reward_mean"] == pytest.approx(0.0) and m_white["loss"] == pytest.approx(m_plain["loss"])
    for p, q in zip(white.engine.module.parameters(), plain.engine.module.parameters()):
        torch.testing.assert_close(p, q)
    moved = sum(float((p - q).abs().sum()) for p, q in zip(white.engine.module.parameters(), base.parameters()))
    assert moved > 0  # it did train


def test_a_batch_without_the_policys_tokens_is_refused_by_name():
    actor = make_actor(tiny(0), lr=1e-3)
    actor.policy = "white"
    with pytest.raises(ValueError, match="'white'"):
        actor.prepare([Trajectory([1, 2, 3], [0, 1, 1], [0, -1, -1], [-1, 0, 0], 0.5, "p")])


def test_staleness_counts_each_policys_own_versions():
    """White's tokens are at white's version 3, black's at black's 7: each learner judges by its own."""
    from arl.api.staleness import StalenessPolicy
    from arl.learner.worker import staleness_counts

    group = [game([[5, 6]], [[7]], 1.0, "g")]
    rule = StalenessPolicy(1)
    assert not rule.group_is_stale(group, 4, "white") and rule.group_is_stale(group, 4 + 4, "white")
    assert not rule.group_is_stale(group, 8, "black") and rule.group_is_stale(group, 9, "black")
    assert staleness_counts(group, 4, "white") == {1: 2} and staleness_counts(group, 8, "black") == {1: 1}

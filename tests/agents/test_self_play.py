"""The self-play agent on Nim with a fake engine: seats as chats of their own, zero-sum rewards, the opponent's
policy on its requests, evaluation as a game against `eval_opponent`."""

import pytest

from arl.agents.self_play import SelfPlayAgent
from arl.api import GenerationConfig
from arl.envs.nim import NimEnv, optimal_move
from tests.agents.test_math_agents import TOK, FakeEngine, ids, sample

GCONF = GenerationConfig(max_new_tokens=3, temperature=1.0)


def chat(text):
    return TOK.encode(f"<|user|>{text}<|assistant|>", add_special_tokens=False)


class Groups:
    """An env group as the rollout worker passes one: member i is its own NimEnv."""

    def __init__(self):
        self.members = {}

    async def member(self, i):
        return self.members.setdefault(i, NimEnv())


@pytest.mark.asyncio
async def test_both_seats_are_the_runs_policy_and_the_winner_gets_one():
    # pile 6: seat 0 takes 2 (pile 4), seat 1 takes 1 (3), seat 0 takes 3 and wins
    moves = {"pile 6": "2", "pile 4": "1", "pile 3": "3"}

    def script(req, k):
        last = TOK.decode(req.input_ids.tolist()).rsplit("<|user|>", 1)[1].split("<|assistant|>")[0]
        return [sample(ids(moves[last]), version=4)]

    eng = FakeEngine(script)
    trajs = await eng.drive(SelfPlayAgent(TOK, GCONF, group_size=2), prompt={"id": "g", "pile": 6}, env=Groups())
    assert all(r.policy is None for r in eng.requests) and len(eng.requests) == 3
    first, second = trajs
    assert [t.reward for t in trajs] == [1.0, 0.0] and first.metadata["seat"] == 0 and first.metadata["solved"]
    assert first.input_ids.tolist() == chat("pile 6") + ids("2") + chat("pile 3") + ids("3")
    assert first.loss_mask.tolist() == [0] * len(chat("pile 6")) + [1] * 2 + [0] * len(chat("pile 3")) + [1] * 2
    assert second.input_ids.tolist() == chat("pile 4") + ids("1")
    assert first.metadata["turns"] == 2 and second.metadata["turns"] == 1 and first.group_id == second.group_id
    assert [e[0] for e in first.metadata["token_ledger"]] == ["prompt", "engine", "observation", "engine"]


@pytest.mark.asyncio
async def test_against_a_named_opponent_only_the_runs_seat_is_returned_and_seats_alternate():
    def script(req, k):
        return [sample(ids("1"), version=0 if req.policy else 7)]  # everyone takes 1: pile 5 -> seat 0 wins

    eng = FakeEngine(script)
    trajs = await eng.drive(SelfPlayAgent(TOK, GCONF, group_size=2, opponent="start", filter_uniform_groups=False),
                            prompt={"id": "g", "pile": 5}, env=Groups())
    assert sorted(t.metadata["seat"] for t in trajs) == [0, 1]
    assert {t.metadata["seat"]: t.reward for t in trajs} == {0: 1.0, 1: 0.0}
    assert {t.metadata["opponent"] for t in trajs} == {"start"} and not any(t.policy_spans for t in trajs)
    assert sum(r.policy == "start" for r in eng.requests) == 5  # 5 moves each game, the opponent's 3 + 2
    for t in trajs:
        assert set(t.versions[t.loss_mask.astype(bool)].tolist()) == {7}


@pytest.mark.asyncio
async def test_a_trained_opponent_plays_both_orders_and_each_seat_is_recorded_under_its_policy():
    """`train_opponent`: group_size / 2 games against the opponent, seats alternating, both seats returned; the
    opponent's trajectory names it in `policy_spans`, so only its learner trains it (`docs/multi_policy.md`)."""
    def script(req, k):
        return [sample(ids("1"), version=3 if req.policy else 7)]  # everyone takes 1: pile 5 -> seat 0 wins

    eng = FakeEngine(script)
    agent = SelfPlayAgent(TOK, GCONF, group_size=4, opponent="rival", train_opponent=True)
    trajs = await eng.drive(agent, prompt={"id": "g", "pile": 5}, env=Groups())
    assert len(trajs) == 4 and len(eng.requests) == 10  # two games of five moves
    rival = [t for t in trajs if t.policy_spans]
    own = [t for t in trajs if not t.policy_spans]
    assert len(rival) == len(own) == 2 and all(t.owned_by("rival").any() for t in rival)
    assert sorted(t.metadata["seat"] for t in rival) == [0, 1]  # the rival moved first in one game, second in one
    assert {int(t.versions[t.owned_by("rival")].max()) for t in rival} == {3}  # its own versions
    assert sorted(t.reward for t in own) == [0.0, 1.0] and all(t.metadata["opponent"] == "rival" for t in own)


@pytest.mark.asyncio
@pytest.mark.parametrize("seed, won", [(10, True), (11, False)])
async def test_evaluation_plays_the_eval_opponent_from_the_rows_seat(seed, won):
    # pile 5 + (seed // 2) % 16 = 10 for seeds 10 and 11, both players optimal (pile % 4, else 1): who moves first
    # wins; the frozen policy's requests name it, and only the run's seat comes back
    def script(req, k):
        pile = int(TOK.decode(req.input_ids.tolist()).rsplit("pile ", 1)[1].split("<")[0])
        return [sample(ids(str(optimal_move(pile) or 1)), version=0 if req.policy == "start" else 5)]

    eng = FakeEngine(script)
    agent = SelfPlayAgent(TOK, GCONF.new(greedy=True), group_size=1, eval_opponent="start",
                          filter_uniform_groups=False)
    (traj,) = await eng.drive(agent, prompt={"id": f"seed-{seed}", "seed": seed}, env=Groups())
    assert traj.metadata["seat"] == seed % 2 and traj.metadata["first_correct"] is won
    assert {r.policy for r in eng.requests} == {None, "start"}
    assert set(traj.versions[traj.loss_mask.astype(bool)].tolist()) == {5}


@pytest.mark.asyncio
async def test_evaluation_counts_a_game_the_opponent_lost_before_the_run_moved():
    eng = FakeEngine(lambda req, k: [sample(ids("9"))])  # the frozen start's first move is illegal
    agent = SelfPlayAgent(TOK, GCONF, group_size=1, eval_opponent="start", filter_uniform_groups=False)
    (traj,) = await eng.drive(agent, prompt={"id": "s", "seed": 1}, env=Groups())
    assert traj.metadata["first_correct"] and traj.loss_mask.sum() == 0
    assert traj.metadata["termination"] == "opponent_illegal" and traj.metadata["prompt_id"] == "s"


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="even"):
        SelfPlayAgent(TOK, GCONF, group_size=3)
    with pytest.raises(ValueError, match="opponent"):
        SelfPlayAgent(TOK, GCONF, opponent="")
    with pytest.raises(ValueError, match="train_opponent=true needs opponent"):
        SelfPlayAgent(TOK, GCONF, train_opponent=True)
    with pytest.raises(ValueError, match="even"):
        SelfPlayAgent(TOK, GCONF, group_size=3, opponent="rival", train_opponent=True)


@pytest.mark.asyncio
async def test_the_envs_move_stats_are_summed_per_seat():
    # pile 6, everyone takes 1: seat 0 at 6 (winning move 2: missed), 4 (none), 2 (2: missed); seat 1 at 5 (1:
    # taken), 3 (3: missed), 1 (1: taken, wins)
    eng = FakeEngine(lambda req, k: [sample(ids("1"))])
    first, second = await eng.drive(SelfPlayAgent(TOK, GCONF, group_size=2), prompt={"id": "g", "pile": 6},
                                    env=Groups())
    assert (first.metadata["winning_chances"], first.metadata["winning_moves"]) == (2, 0)
    assert (second.metadata["winning_chances"], second.metadata["winning_moves"]) == (3, 2)
    assert second.reward == 1.0

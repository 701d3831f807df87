"""The proposer-solver agent with a fake engine: the row anchors the proposals, valid ones go to the solver, the
proposer is paid for problems solved about half the time, repeats / held-out problems / junk pay nothing, and
evaluation is the solver alone."""

import pytest

from arl.agents.proposer_solver import ProposerSolverAgent, anchor_of, parse_operand, proposer_reward
from arl.api import GenerationConfig
from arl.data.arith import make_arith_splits
from arl.envs.math import MathEnv
from tests.agents.test_math_agents import TOK, FakeEngine, ids, sample

GCONF = GenerationConfig(max_new_tokens=4, temperature=1.0)
TRAIN, TEST = make_arith_splits(49, 200, seed=0)


class Envs:
    async def member(self, i):
        return MathEnv()


def user_text(req):
    return TOK.decode(req.input_ids.tolist()).split("<|user|>")[1].split("<|assistant|>")[0]


@pytest.mark.asyncio
async def test_a_group_pays_the_proposer_for_problems_solved_half_the_time():
    a = 12
    test_bs = {int(r["id"].split("+")[1]) for r in TEST if r["id"].startswith(f"{a}+")}
    train_bs = sorted({int(r["id"].split("+")[1]) for r in TRAIN if r["id"].startswith(f"{a}+")})
    easy, half, hard = train_bs[:3]
    held_out = min(test_bs)
    proposals = [f"{easy}=", f"{half}=", f"{hard}", "x", f"{held_out}=", f"{half}=", "77=", f"{easy}="]
    right = {easy: 4, half: 2, hard: 0}  # right answers of 4 per problem

    def script(req, k):
        text = user_text(req)
        if text.startswith("propose"):
            assert text == f"propose {a}+" and req.gconfig.n == 8
            return [sample(ids(p)) for p in proposals]
        b = int(text.split("+")[1].rstrip("="))
        return [sample(ids(str(a + b) if j < right[b] else "0")) for j in range(req.gconfig.n)]

    eng = FakeEngine(script)
    agent = ProposerSolverAgent(TOK, GCONF, group_size=8, solver_attempts=4, held_out=TEST)
    trajs = await eng.drive(agent, prompt={"id": f"{a}+3", "prompt": f"{a}+3=", "answer": "15"}, env=Envs())
    props = [t for t in trajs if t.metadata["role"] == "proposer"]
    assert [t.reward for t in props] == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert [t.metadata.get("valid") for t in props] == [True, True, True, False, False, False, False, False]
    assert props[3].metadata["invalid"] and props[4].metadata["held_out"] and props[5].metadata["repeat"]
    assert props[6].metadata["invalid"] and props[1].metadata["solve_rate"] == 0.5
    solved = [t for t in trajs if t.metadata["role"] == "solver"]
    # the easy and the hard problem's answers are uniform (no signal): only the half-solved one's are trained
    assert len(solved) == 4 and {t.group_id for t in solved} == {props[0].group_id.replace("propose", "solve1")}
    assert sorted(t.reward for t in solved) == [0.0, 0.0, 1.0, 1.0]
    assert len(eng.requests) == 4  # one proposal request, one solver request per valid problem (3)


@pytest.mark.asyncio
async def test_a_proposer_policy_of_its_own_writes_the_problems_and_owns_their_tokens():
    """`proposer=NAME`: the proposal request names the policy and each proposal is recorded under it, so only
    its learner trains the proposals; the solver's answers stay the run's own."""
    def script(req, k):
        if user_text(req).startswith("propose"):
            assert req.policy == "proposer"
            return [sample(ids("3="), version=2) for _ in range(req.gconfig.n)]
        assert req.policy is None
        return [sample(ids("15" if j % 2 else "0"), version=5) for j in range(req.gconfig.n)]

    eng = FakeEngine(script)
    agent = ProposerSolverAgent(TOK, GCONF, group_size=2, solver_attempts=2, proposer="proposer",
                                filter_uniform_groups=False)
    trajs = await eng.drive(agent, prompt={"id": "12+1", "prompt": "12+1=", "answer": "13"}, env=Envs())
    props = [t for t in trajs if t.metadata["role"] == "proposer"]
    solved = [t for t in trajs if t.metadata["role"] == "solver"]
    assert len(props) == 2 and all(t.owned_by("proposer").any() and not t.owned_by(None).any() for t in props)
    assert solved and all(t.owned_by(None).any() and not t.policy_spans for t in solved)
    assert props[0].reward == 1.0  # 12+3 solved half the time
    with pytest.raises(ValueError, match="proposer must be"):
        ProposerSolverAgent(TOK, GCONF, proposer="")


@pytest.mark.asyncio
async def test_evaluation_is_the_solver_alone_on_the_row():
    eng = FakeEngine(lambda req, k: [sample(ids("15"))])
    agent = ProposerSolverAgent(TOK, GCONF.new(greedy=True), group_size=1, filter_uniform_groups=False)
    env = MathEnv()
    (t,) = await eng.drive(agent, prompt={"id": "12+3", "prompt": "12+3=", "answer": "15"}, env=env)
    assert user_text(eng.requests[0]) == "12+3=" and t.metadata["first_correct"] and t.reward == 1.0


def test_pieces():
    assert [proposer_reward(p) for p in (0.0, 0.25, 0.5, 1.0)] == [0.0, 0.5, 1.0, 0.0]
    assert parse_operand(" 30=", 49) == 30 and parse_operand("50", 49) is None and parse_operand("3+4", 49) is None
    assert anchor_of({"prompt": "17+2="}, 49) == 17 and 0 <= anchor_of({"id": "seed-3"}, 49) <= 49
    with pytest.raises(ValueError, match="solver_attempts"):
        ProposerSolverAgent(TOK, GCONF, solver_attempts=1)

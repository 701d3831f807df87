"""Env groups: partition counts, seeds shared within a group (and only there), one env instance per trajectory."""

import asyncio

import pytest

from arl.api import EnvironmentService
from arl.rollout.env_groups import (
    EnvGroup,
    EnvGroupPool,
    check_env_capacity,
    group_seed,
    partition_groups,
    worker_groups,
)


class SeedEnv(EnvironmentService):
    made = 0

    def __init__(self, kind="a"):
        SeedEnv.made += 1
        self.kind, self.seed, self.options, self.steps, self.closed = kind, None, None, 0, False

    async def reset(self, seed=None, options=None):
        self.seed, self.options, self.steps = seed, options, 0
        return self.seed, {}

    async def step(self, action):
        self.steps += 1
        return None, float(self.seed % 7), True, False, {}

    async def close(self):
        self.closed = True


def test_partition_counts():
    tags = partition_groups(10, ["sokoban", "frozenlake", "math"])
    assert [tags.count(t) for t in ["sokoban", "frozenlake", "math"]] == [4, 3, 3]
    tags = partition_groups(8, ["a", "b"], [6, 2])
    assert tags == ["a"] * 6 + ["b"] * 2
    for bad in [(8, ["a", "b"], [5, 2]), (8, ["a", "b"], [8]), (8, ["a", "a"], None), (0, ["a"], None),
                (4, [], None), (4, ["a", "b"], [5, -1])]:
        with pytest.raises(ValueError):
            partition_groups(*bad)


def test_worker_assignment_and_capacity():
    assert [worker_groups(10, 3, w) for w in range(3)] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert sorted(g for w in range(3) for g in worker_groups(10, 3, w)) == list(range(10))
    check_env_capacity(10, 3, 8, 32)
    with pytest.raises(ValueError, match="max_env_num_per_worker"):
        check_env_capacity(10, 3, 8, 31)
    check_env_capacity(10, 3, 8, 0)  # 0: no limit


def test_seeds_are_deterministic_and_distinct():
    assert group_seed(1, 3, 0) == group_seed(1, 3, 0)
    seeds = {group_seed(1, g, e) for g in range(20) for e in range(20)}
    assert len(seeds) == 400 and all(0 <= s < 2**31 for s in seeds)


@pytest.mark.asyncio
async def test_group_members_share_seed_and_options_but_not_instances():
    g = EnvGroup(lambda: SeedEnv(), size=4, tag="a", index=0)
    await g.fill()
    await g.reset(seed=123, options={"answer": "5"})
    members = [await g.member(i) for i in range(4)]
    assert len({id(m) for m in members}) == 4
    assert {m.seed for m in members} == {123} and all(m.options == {"answer": "5"} for m in members)
    extra = await g.member(6)  # made on demand (tree leaves), reset like the others
    assert extra.seed == 123 and len(g.members) == 7
    await g.reset(options={"answer": "6"})  # an agent's own reset keeps the group seed
    assert all(m.seed == 123 and m.options == {"answer": "6"} for m in g.members)
    await g.step("x")
    assert members[0].steps == 1 and members[1].steps == 0  # plain-env agents act on member 0
    await g.close()
    assert all(m.closed for m in members)


@pytest.mark.asyncio
async def test_pool_reuses_groups_with_new_seeds_and_tags():
    factories = {"a": lambda: SeedEnv("a"), "b": lambda: SeedEnv("b")}
    tags = partition_groups(4, ["a", "b"], [3, 1])
    mine = worker_groups(4, 2, 0)  # worker 0 of 2 hosts groups 0 and 2
    pool = EnvGroupPool(factories, [tags[g] for g in mine], group_size=3, group_indices=mine, base_seed=7)
    assert pool.capacity == 2
    g1 = await pool.acquire(options={"id": "p1"})
    g2 = await pool.acquire(options={"id": "p2"})
    assert {g1.index, g2.index} == {0, 2} and {g1.tag, g2.tag} == {"a"}
    assert len({m.seed for m in g1.members}) == 1 and g1.members[0].seed == group_seed(7, g1.index, 0)
    assert g1.members[0].seed != g2.members[0].seed
    with pytest.raises(asyncio.TimeoutError):  # both busy
        await pool.acquire(timeout=0.05)
    first = list(g1.members)
    await pool.release(g1)
    g3 = await pool.acquire(options={"id": "p3"})
    assert g3 is g1 and g3.members == first  # pooled: same instances, reset with the next episode's seed
    assert {m.seed for m in g3.members} == {group_seed(7, g1.index, 1)} and g3.members[0].options == {"id": "p3"}
    await pool.close()


@pytest.mark.asyncio
async def test_unpooled_groups_are_fresh_and_closed_on_release():
    pool = EnvGroupPool({"m": lambda: SeedEnv()}, [], group_size=2, default_tag="m")
    assert pool.capacity is None
    g = await pool.acquire(options={}, seed=5)
    m = await g.member(1)
    assert m.seed == 5
    await pool.release(g)
    assert m.closed


def test_config_checks_env_groups_before_anything_starts():
    from arl.builtin import load_builtins
    from arl.config import ConfigError, ExperimentConfig, parse_overrides

    load_builtins()
    cfg = parse_overrides(ExperimentConfig, ["rollout.num_env_groups=8", "rollout.tags=[math,math2]",
                                             "rollout.num_groups_partition=[6,2]", "rollout.group_size=4",
                                             "rollout.num_workers=2", "rollout.max_env_num_per_worker=16"])
    assert cfg.rollout.tags == ["math", "math2"] and cfg.rollout.num_groups_partition == [6, 2]
    for bad, msg in [(["rollout.num_env_groups=8", "rollout.tags=[a,b]", "rollout.num_groups_partition=[5,2]"],
                      "sum to num_env_groups"),
                     (["rollout.num_env_groups=8", "rollout.max_env_num_per_worker=8"], "max_env_num_per_worker"),
                     (["rollout.num_env_groups=1", "rollout.num_workers=2"], "num_env_groups=1 < rollout.num_workers")]:
        with pytest.raises(ConfigError, match=msg):
            parse_overrides(ExperimentConfig, bad)


class EpisodeEnv(EnvironmentService):
    """A gymnasium-like env wrapped by hand: reset stores the episode's target (slowly), step reads it."""

    def __init__(self):
        self.state = {}
        self.resets = []

    async def reset(self, seed=None, options=None):
        await asyncio.sleep(0.01)  # a real reset takes a while: other chains run meanwhile
        self.state = {"target": options["target"]}
        self.resets.append(options["target"])
        return None, {}

    async def step(self, action):
        target = self.state.pop("target")  # one step per episode: a second one finds no episode (KeyError)
        return None, float(action == target), True, False, {}


@pytest.mark.asyncio
async def test_chains_that_share_the_env_they_were_given_are_refused_clearly():
    """Several chains each reset the env they were given with their own options, then step: they must not share
    one instance by accident (it mixed their options and failed with a KeyError); the second chain is refused."""
    g = EnvGroup(EpisodeEnv, size=3)

    async def chain(i):
        await g.reset(options={"target": f"t{i}"})
        return (await g.step(f"t{i}"))[1]

    results = await asyncio.gather(*(chain(i) for i in range(3)), return_exceptions=True)
    assert [m.resets for m in g.members] == [["t0"]]  # reset with the options of its own call, by one chain
    assert results[0] == 1.0  # the first chain had the env to itself; the others are told what to do instead
    assert [type(r).__name__ for r in results[1:]] == ["EnvSharedError"] * 2
    assert "env_for(env, i)" in str(results[1])

    # what the message says works: each chain takes its own member
    from arl.agents.common import env_for

    g = EnvGroup(EpisodeEnv, size=2)

    async def own_chain(i):
        env = await env_for(g, i)
        await env.reset(options={"target": f"t{i}"})
        return (await env.step(f"t{i}"))[1]

    assert await asyncio.gather(*(own_chain(i) for i in range(2))) == [1.0, 1.0]


@pytest.mark.asyncio
async def test_one_chain_may_use_the_group_from_its_own_tasks_one_at_a_time():
    from arl.rollout.env_groups import EnvSharedError

    g = EnvGroup(lambda: SeedEnv(), size=3)
    await g.reset(seed=1, options={"answer": "5"})  # the agent's task resets the group for its chains ...
    assert all(m.options == {"answer": "5"} for m in [await g.member(i) for i in range(3)])
    for _ in range(2):  # ... steps in sub-tasks it starts one after the other are the same chain
        await asyncio.create_task(g.step("x"))
    assert g.members[0].steps == 2

    async def chain():  # a chain of two turns
        for _ in range(2):
            await asyncio.sleep(0.01)
            await g.step("x")

    # chains that all step the group it reset would share member 0 at once: the second is refused
    out = await asyncio.gather(chain(), chain(), return_exceptions=True)
    assert sum(isinstance(r, EnvSharedError) for r in out) == 1
    # a new episode from the pool frees the group for the next prompt's chains
    await g.new_episode(seed=2, options={"answer": "6"})
    assert await asyncio.create_task(g.step("x")) and all(m.options == {"answer": "6"} for m in g.members)

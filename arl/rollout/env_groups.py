"""Environment groups (ROLL style): every trajectory gets its own env instance; the `group_size` envs of one group
share their env type (tag), config and seed, so their trajectories are comparable for group advantages.

Config (`rollout.*`):
    num_env_groups         env groups over all rollout workers (0: one fresh group per prompt group, no pool)
    group_size             envs per group = trajectories per prompt (0: agent.group_size)
    tags                   env types, each a registered env name or a key of `env_configs` (empty: [env.name])
    num_groups_partition   groups per tag (empty: an even split, the first tags get the remainder)
    max_env_num_per_worker most env instances one rollout worker may hold (0: no limit)

Global group g has tag `partition_groups(...)[g]` and lives on rollout worker `g % num_workers`. Its k-th episode
is reset with seed `group_seed(base, g, k)`, the same for all its members. Groups are pooled: a finished prompt
group hands its EnvGroup back and the next one resets it (members are reused, never shared by two trajectories
at once). Validation (eval) uses a group of one at temperature 0.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import itertools
from typing import Any, Callable, Optional, Sequence

from arl.api.agent import EnvironmentService
from arl.config import check_env_capacity, partition_groups, worker_groups  # config checks them before any start

__all__ = ["partition_groups", "group_seed", "worker_groups", "check_env_capacity", "EnvGroup", "EnvGroupPool",
           "EnvGroupSpec", "worker_spec", "EnvSharedError"]

EnvFactory = Callable[[], EnvironmentService]

_CLAIMS: contextvars.ContextVar[frozenset[int]] = contextvars.ContextVar("arl_env_group_claims", default=frozenset())
_claim_ids = itertools.count(1)


class EnvSharedError(RuntimeError):
    """Two chains of an agent called reset/step on the one env it was given."""


def group_seed(base_seed: int, group_index: int, episode: int) -> int:
    """A 31-bit seed, the same for every member of group `group_index` in its `episode`-th reset."""
    h = hashlib.sha256(f"{base_seed}:{group_index}:{episode}".encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


class EnvGroup(EnvironmentService):
    """`size` env instances of one tag that are reset together with one seed and the same options.

    Agents that know about groups take `await group.member(i)` for trajectory i (members beyond `size` are made
    on demand, e.g. for tree leaves, and reset the same way). For agents that use the env they are given as
    one env, `step`/`reset` act on member 0 (and reset all members).
    """

    def __init__(self, make_env: EnvFactory, size: int, tag: str = "", index: int = -1) -> None:
        if size < 1:
            raise ValueError(f"EnvGroup size must be >= 1, got {size}")
        self._make_env = make_env
        self.size = size
        self.tag = tag
        self.index = index
        self.members: list[EnvironmentService] = []
        self.seed: Optional[int] = None
        self.options: Optional[dict[str, Any]] = None
        self.episodes = 0  # episodes handed out by a pool (it derives the next seed from it)
        self._was_reset = False
        self._lock = asyncio.Lock()
        self._owner: Optional[asyncio.Task] = None  # the chain (task) that uses reset/step on the group
        self._claim = 0  # its claim id, in the context of the tasks it starts after its first call
        self._helper: Optional[asyncio.Task] = None  # the one task of that chain besides its own using them now

    async def reset(self, seed: Optional[int] = None, options: Optional[dict[str, Any]] = None) -> tuple[Any, dict]:
        """Reset every member with the same seed and these options (a None seed keeps the group's current one).
        EnvSharedError when another chain uses the group (see the module docstring)."""
        self._check_chain("reset")
        return await self._reset_members(seed, options)

    async def new_episode(self, seed: Optional[int], options: Optional[dict[str, Any]]) -> tuple[Any, dict]:
        """The pool's reset for a new prompt group: every member reset, no chain holds the group any more."""
        self._owner = self._helper = None
        return await self._reset_members(seed, options)

    async def _reset_members(self, seed: Optional[int], options: Optional[dict[str, Any]]) -> tuple[Any, dict]:
        opts = dict(options) if options is not None else None  # this call's: never another caller's
        async with self._lock:
            if seed is not None:
                self.seed = int(seed)
            self.options, self._was_reset = opts, True  # what members made later are reset with
            if not self.members:
                self.members.append(self._make_env())
            results = await asyncio.gather(*(m.reset(seed=self.seed, options=None if opts is None else dict(opts))
                                             for m in self.members))
        return results[0]

    def _check_chain(self, what: str) -> None:
        """reset/step on the group serve one chain: the first task that calls them (again any task once it ended),
        plus one task at a time of those it started after its first call; anything else is refused."""
        task = asyncio.current_task()
        if task is None or task is self._owner:
            return
        if self._owner is None or self._owner.done():
            self._owner, self._claim, self._helper = task, next(_claim_ids), None
            _CLAIMS.set(_CLAIMS.get() | {self._claim})
            return
        if self._claim in _CLAIMS.get() and (self._helper is None or self._helper.done() or self._helper is task):
            self._helper = task
            return
        raise EnvSharedError(
            f"env.{what}() was called by a second chain while another chain uses this env: the env an agent is "
            f"given serves one chain. Give chain i its own instance: `env_i = await env_for(env, i)` "
            f"(arl.agents.common) or `await env.member(i)`; every member is reset with the group's seed and options.")

    def _opts(self) -> Optional[dict[str, Any]]:
        return dict(self.options) if self.options is not None else None

    async def member(self, i: int) -> EnvironmentService:
        """Member `i` (its own instance), made and reset like the others if it does not exist yet."""
        if i < 0:
            raise IndexError(f"env group member index must be >= 0, got {i}")
        async with self._lock:
            while len(self.members) <= i:
                env = self._make_env()
                if self._was_reset:
                    await env.reset(seed=self.seed, options=self._opts())
                self.members.append(env)
            return self.members[i]

    async def fill(self) -> None:
        """Make all `size` members now (pools do this once, so each trajectory finds its env ready)."""
        await self.member(self.size - 1)

    async def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        """Step member 0 (EnvSharedError when another chain uses the group)."""
        self._check_chain("step")
        return await (await self.member(0)).step(action)

    @property
    def failure(self) -> Optional[str]:
        """The first member failure recorded by a deadline guard (`GuardedEnv.failure`), if any."""
        return next((f for f in (getattr(m, "failure", None) for m in self.members) if f), None)

    async def close(self) -> None:
        members, self.members = self.members, []
        await asyncio.gather(*(m.close() for m in members), return_exceptions=True)


class EnvGroupPool:
    """The env groups of one rollout worker. `acquire()` hands out a free group (oldest released first) and
    resets it with its next seed; `release()` takes it back. With no fixed groups (`group_indices` empty) every
    acquire makes a fresh group that release closes (the behaviour without env groups)."""

    def __init__(self, factories: dict[str, EnvFactory], group_tags: Sequence[str], group_size: int,
                 group_indices: Sequence[int] = (), base_seed: int = 0, default_tag: str = "") -> None:
        if group_indices and len(group_indices) != len(group_tags):
            raise ValueError("group_indices and group_tags must have the same length")
        missing = sorted({t for t in group_tags if t not in factories} | ({default_tag} - set(factories)
                                                                           if not group_indices else set()))
        if missing:
            raise ValueError(f"no env factory for tags {missing}; known: {sorted(factories)}")
        self.factories = factories
        self.group_size = group_size
        self.base_seed = base_seed
        self.default_tag = default_tag
        self.pooled = bool(group_indices)
        self._free: asyncio.Queue = asyncio.Queue()
        self.groups = [EnvGroup(factories[t], group_size, tag=t, index=g) for t, g in zip(group_tags, group_indices)]
        for g in self.groups:
            self._free.put_nowait(g)
        self._fresh = 0

    @property
    def capacity(self) -> Optional[int]:
        """How many groups can run at once (None: unbounded)."""
        return len(self.groups) if self.pooled else None

    async def acquire(self, options: Optional[dict[str, Any]] = None, timeout: Optional[float] = None,
                      seed: Optional[int] = None) -> EnvGroup:
        """A group reset for a new episode: all members get the same seed (`seed`, or the group's next one).
        `timeout` bounds the wait for a free pooled group; env calls get their deadlines from the wrapper the
        pool's factories apply (the rollout worker's `GuardedEnv`)."""
        if self.pooled:
            group = await asyncio.wait_for(self._free.get(), timeout)
            if len(group.members) < self.group_size:
                try:
                    await group.fill()
                except BaseException:
                    self._free.put_nowait(group)
                    raise
        else:
            group = EnvGroup(self.factories[self.default_tag], self.group_size, tag=self.default_tag,
                             index=-1 - self._fresh)
            self._fresh += 1
        s = seed if seed is not None else group_seed(self.base_seed, group.index, group.episodes)
        group.episodes += 1
        try:
            await group.new_episode(seed=s, options=options)
        except BaseException:
            await self.release(group)
            raise
        return group

    async def release(self, group: EnvGroup) -> None:
        """Hand a group back (pooled) or close it (fresh). A pooled group whose env failed gets new members."""
        if self.pooled and group in self.groups:
            if group.failure is not None:
                await group.close()
            self._free.put_nowait(group)
        else:
            await group.close()

    async def close(self) -> None:
        await asyncio.gather(*(g.close() for g in self.groups), return_exceptions=True)


class EnvGroupSpec:
    """What one rollout worker needs to build its `EnvGroupPool`: env factories by tag, and its groups (global
    indices and tags; empty: no pool, a fresh group per prompt group of `default_tag`)."""

    def __init__(self, factories: dict[str, EnvFactory], group_size: int, group_indices: Sequence[int] = (),
                 group_tags: Sequence[str] = (), default_tag: str = "") -> None:
        self.factories = dict(factories)
        self.group_size = int(group_size)
        self.group_indices = list(group_indices)
        self.group_tags = list(group_tags)
        self.default_tag = default_tag or (self.group_tags[0] if self.group_tags else next(iter(self.factories)))

    def pool(self, wrap: Callable[[EnvironmentService], EnvironmentService] = lambda e: e,
             base_seed: int = 0) -> EnvGroupPool:
        """The pool, with every env instance passed through `wrap` (the worker's deadline guard)."""
        factories = {t: (lambda f=f: wrap(f())) for t, f in self.factories.items()}
        return EnvGroupPool(factories, self.group_tags, self.group_size, self.group_indices, base_seed=base_seed,
                            default_tag=self.default_tag)


def worker_spec(*, make_env: Callable[..., EnvironmentService], env_name: str, env_args: dict[str, Any],
                group_size: int, num_env_groups: int = 0, tags: Sequence[str] = (),
                num_groups_partition: Sequence[int] = (), max_env_num_per_worker: int = 0,
                env_configs: Optional[dict[str, Any]] = None, num_workers: int = 1, worker: int = 0) -> EnvGroupSpec:
    """The `EnvGroupSpec` of rollout worker `worker` from the `rollout.*` settings (see the module docstring)."""
    tags = list(tags) or [env_name]
    # env factory per tag: `env_configs[tag]` = {"name": registered env, "args": {...}}, else the tag is a
    # registered env name (with `env_args` when it is the experiment's env.name)
    env_configs = env_configs or {}
    factories: dict[str, EnvFactory] = {}
    for tag in tags:
        spec = dict(env_configs.get(tag) or {})
        name = str(spec.get("name", tag))
        args = dict(spec.get("args", env_args if name == env_name and tag not in env_configs else {}))
        factories[tag] = lambda name=name, args=args: make_env(name, **args)
    if num_env_groups <= 0:
        return EnvGroupSpec(factories, group_size, default_tag=tags[0])
    check_env_capacity(num_env_groups, num_workers, group_size, max_env_num_per_worker)
    all_tags = partition_groups(num_env_groups, tags, list(num_groups_partition) or None)
    mine = worker_groups(num_env_groups, num_workers, worker)
    if not mine:
        raise ValueError(f"rollout worker {worker} has no env group: num_env_groups={num_env_groups} < "
                         f"rollout.num_workers={num_workers}")
    return EnvGroupSpec(factories, group_size, mine, [all_tags[g] for g in mine])

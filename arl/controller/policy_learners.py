"""The controller's side of the trainable listed policies (`docs/multi_policy.md`): what it does when one's learner
(`learner<k>`, k >= 1) publishes or drops, when a server loads one's adapter, and at the run's end.

`PolicyWeights` (pure) says what to send; this carries it out through the controller it is given (its sends, its
gate, its reporter), so the shell only forwards the messages of learners 1.. here. Each policy's bound in the
staleness gate (`StalenessGate.others`) moves with its live version and its learner's drops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Optional

from arl.controller.policy_weights import PolicySend, PolicyWeights
from arl.transport import messages as m

logger = logging.getLogger("arl.controller")

STEP_KEYS = ("reward_mean", "loss", "grad_norm", "clip_frac")  # of a policy's step, in its `policy_step` record


class PolicyLearners:
    def __init__(self, ctl: Any, policies: dict[str, list[int]], total_steps: int) -> None:
        """`ctl`: the `Controller` (its weight sync's lost servers, gate, reporter, sends); `policies`: each
        trainable listed policy (the k-th is learner k's) -> the servers that serve it ([]: all); `total_steps`:
        each learner's steps."""
        self.ctl, self.total_steps = ctl, total_steps
        self.weights = PolicyWeights(list(policies), ctl.sup.num_inference, placement=policies)
        ctl.gate.others.update({n: (0, 0) for n in policies})  # each trained policy bounds admission from start

    def route(self, key: Any, msg: m.ControlMessage) -> Optional[Awaitable[None]]:
        """What to do with `msg` from role `key`, if it is this piece's: a trainable listed policy's learner's
        publication or drops, a server's load of a policy's adapter; None: the shell's own handler."""
        if key is not None and key[0] == "learner" and key[1]:
            if isinstance(msg, m.WeightsPublished):
                return self.published(key[1], msg)
            if isinstance(msg, m.GroupsDropped):
                return self.dropped(key[1], msg)
        if isinstance(msg, m.WeightsLoaded) and msg.policy is not None:
            return self.loaded(msg)
        return None

    async def published(self, index: int, msg: m.WeightsPublished) -> None:
        """Learner `index` published a version: a record, its adapter to every server, old files pruned."""
        policy, lost = self.weights.name(index), self.ctl.weights.lost
        if policy is None:
            return
        self.ctl.reporter.event("policy_step", policy=policy, version=msg.version,
                                **{k: v for k, v in msg.metrics.items() if k in STEP_KEYS})
        await self._send(self.weights.publish(policy, msg.version, msg.path, lost))
        await self.ctl._send_to(("learner", index), m.PruneWeights(below=self.weights.lowest_needed(policy, lost)))

    async def dropped(self, index: int, msg: m.GroupsDropped) -> None:
        """Learner `index` dropped groups (stale, invalid, none of its tokens): its bound gets their budget back;
        no group ends (the run's learner settles groups)."""
        policy = self.weights.name(index)
        if policy is not None:
            self.weights.dropped(policy, msg.n)
            await self._bound(policy)

    async def loaded(self, msg: m.WeightsLoaded) -> None:
        """A server loaded (or failed to load) a version of a policy: the gate may have room, or it is sent again
        (three failures in a row stop the run, named)."""
        policy = str(msg.policy)
        if msg.error is None:
            await self._send(self.weights.loaded(policy, msg.index, msg.version))
            return await self._bound(policy)
        self.ctl.reporter.fault("weight_load_failed", server=msg.index, version=msg.version, policy=policy,
                                error=msg.error[:1000])
        sends, attempts = self.weights.failed(policy, msg.index)
        if attempts >= 3:
            return self.ctl.fail(f"inference server {msg.index} could not load policy {policy!r} v{msg.version} "
                                 f"{attempts} times in a row: {msg.error[:300]}")
        await self._send(sends)

    async def registered(self, msg: m.Register, restarted: bool) -> None:
        """A (restarted) server holds each policy's initial adapter: it gets the newest of each. A restarted
        policy learner is back from its checkpoint (`learner_back`)."""
        if msg.role == "inference":
            await self._send(self.weights.registered(msg.index))
        elif msg.role == "learner" and msg.index and restarted:
            await self.learner_back(msg.index, msg.resumed, msg.address or "")

    async def learner_back(self, index: int, resumed: Any, address: str) -> None:
        """Learner `index`, restarted, resumed from its checkpoint (`Register.resumed`: version and the path of
        its weights): every server goes back to that version of the policy, the rollout workers push to the new
        learner, and the policy's bound counts only what the checkpoint consumed (what the lost process held or
        trained after it is lost to this policy alone: its tokens of later versions arrive as invalid, dropped)."""
        policy = self.weights.name(index)
        state = resumed if isinstance(resumed, dict) else {}
        version, path = state.get("version"), state.get("path")
        if policy is None or type(version) is not int or version < 0 or not isinstance(path, str) or not path:
            return self.ctl.fail(f"learner{index} restart: its resume state names no version and weights "
                                 f"({str(resumed)[:200]})")
        gate = self.ctl.gate
        self.weights.drops[policy] = gate.accepted + gate.learner_dropped - version * gate.batch_size
        await self._send(self.weights.restart(policy, version, path, self.ctl.weights.lost))
        await self._bound(policy)
        await self.ctl.tell_rollouts(m.LearnerRestarted(address=address, version=m.Count(version),
                                                        policy_learner=index))
        why, restarts = self.ctl.health.learner_lost_for, self.ctl.sup.learner_restarts
        self.ctl.reporter.fault("policy_learner_restart", policy=policy, reason=why[:300], to_version=version,
                                restarts=restarts)
        line = (f"learner{index} (policy {policy!r}) died ({why[:200]}); restarted from its checkpoint v{version} "
                f"(restart {restarts} of at most {self.ctl.sup.max_learner_restarts})")
        logger.warning("%s; the policy's tokens of later versions still in flight are dropped as invalid", line)
        self.ctl.reporter.say(line)

    async def finished(self, timeout: float) -> None:
        """The run's learner is done: give the policies' learners `timeout` s to train and report their last step
        too (the final accounting reads their heartbeats)."""
        deadline = time.monotonic() + timeout
        behind = self.weights.behind(self.total_steps, self.ctl.role_stats)
        while behind and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            behind = self.weights.behind(self.total_steps, self.ctl.role_stats)
        if behind:
            logger.warning("the run ends with trainable policies short of %d steps: %s", self.total_steps, behind)

    def accounting(self) -> dict:
        """{"policies": each policy's books} for the summary record ({} in a run of one policy)."""
        if not self.weights.names:
            return {}
        return {"policies": self.weights.accounting(self.ctl.role_stats, self.ctl.weights.lost)}

    async def _bound(self, policy: str) -> None:
        self.ctl.gate.others[policy] = (self.weights.live(policy, self.ctl.weights.lost), self.weights.drops[policy])
        await self.ctl.grant(self.ctl.admission.grant())

    async def _send(self, sends: list[PolicySend]) -> None:
        for s in sends:
            await self.ctl._send_to(("inference", s.server), m.UpdateWeights(version=s.version, path=s.path,
                                                                             policy=s.policy, index=s.server))

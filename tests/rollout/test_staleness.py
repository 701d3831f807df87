import random

from arl.rollout.staleness import StalenessGate
from arl.api.staleness import StalenessPolicy


def test_eta0_admits_one_batch_per_version():
    g = StalenessGate(batch_size=4, policy=StalenessPolicy(0), max_concurrent=100)
    assert g.try_start(10) == 4
    for _ in range(4):
        g.finish(True)
    assert g.try_start(1) == 0  # version 0's batch is complete; wait for weights v1
    g.set_version(1)
    assert g.try_start(10) == 4


def test_rejected_groups_return_budget():
    g = StalenessGate(batch_size=2, policy=StalenessPolicy(1), max_concurrent=100)
    assert g.try_start(10) == 4
    g.finish(False)
    assert g.try_start(10) == 1
    g.release(2)
    assert g.running == 2 and g.try_start(10) == 2


def test_concurrency_and_run_end_caps():
    g = StalenessGate(batch_size=8, policy=StalenessPolicy(4), max_concurrent=3, max_groups=5)
    assert g.try_start(10) == 3
    for _ in range(3):
        g.finish(True)
    assert g.try_start(10) == 2
    assert g.capacity() == 0


def test_simulated_staleness_never_exceeds_eta():
    """With out-of-order completion, a learner that drops too-stale groups (returning their budget) never
    consumes a group more than eta versions behind, and the run keeps making progress."""
    for eta in (0, 1, 2, 5):
        rng = random.Random(eta)
        B = 3
        g = StalenessGate(batch_size=B, policy=StalenessPolicy(eta), max_concurrent=7)
        running: list[int] = []  # start versions
        buffer: list[int] = []
        version = 0
        for _ in range(2000):
            n = g.try_start(rng.randint(0, 3))
            running += [g.version] * n
            if running and rng.random() < 0.6:
                v = running.pop(rng.randrange(len(running)))
                accepted = rng.random() < 0.8
                g.finish(accepted)
                if accepted:
                    buffer.append(v)
            stale = [v for v in buffer if version - v > eta]
            if stale:
                buffer = [v for v in buffer if version - v <= eta]
                g.drop_accepted(len(stale))
            if len(buffer) >= B:
                batch, buffer = buffer[:B], buffer[B:]
                assert version - min(batch) <= eta
                version += 1
                g.set_version(version)
        assert version > 100


def test_a_drop_before_its_groups_acceptance_is_not_lost():
    """The learner's drop of a group can reach the controller before the rollout worker's group_done (two
    connections): at the start of a run there is nothing accepted to take it from; it is taken on acceptance."""
    g = StalenessGate(batch_size=1, policy=StalenessPolicy(0), max_concurrent=100)
    assert g.try_start(5) == 1
    g.drop_accepted(1)  # invalid at the learner, reported before the group's group_done
    g.finish(True)
    assert g.accepted == 0 and g.rejected == 1 and g.try_start(5) == 1  # its budget is back
    g.drop_accepted(3)  # more than could ever be accepted (one running group): no debt beyond it
    assert g.owed == 1
    g.release(1)
    assert g.owed == 0


def test_group_ids_name_their_worker_and_process():
    from arl.rollout.staleness import make_group_id, parse_group_id

    gid = make_group_id(3, "a1b2c3", 17)
    assert parse_group_id(gid) == (3, "a1b2c3") and parse_group_id(gid + ":p7#x") == (3, "a1b2c3")
    assert parse_group_id("p7") is None and parse_group_id("w1.zz g2") is None


def test_every_trained_policy_bounds_admission():
    """A trainable listed policy's learner trains the same groups as the run's (`others`): admission stops at the
    slower policy's bound; the groups a policy's learner dropped give its budget back, and those the run's
    learner dropped (returned to `accepted` already) still count for the other policy."""
    g = StalenessGate(batch_size=2, policy=StalenessPolicy(0), max_concurrent=100)
    g.others["rival"] = (0, 0)
    assert g.try_start(10) == 2
    for _ in range(2):
        g.finish(True)
    g.set_version(1)  # the run's policy moved on, the rival's did not
    assert g.try_start(10) == 0
    g.others["rival"] = (1, 0)
    assert g.try_start(10) == 2
    for _ in range(2):
        g.finish(True)
    g.set_version(2)
    g.drop_accepted(1)  # the run's learner dropped one of them: the rival still holds it
    g.others["rival"] = (2, 0)
    assert g.capacity() == 2  # the rival's room (6 - 4), not the run's (6 - 3)
    g.others["rival"] = (2, 1)  # the rival's learner dropped one too
    assert g.capacity() == 3


def test_the_run_ends_admitting_once_every_trained_policy_has_its_groups():
    """A listed policy's learner that dropped more than the run's needs replacements even after the run's own
    learner has all its groups: admission goes on until the policy that holds fewest has `max_groups`."""
    g = StalenessGate(batch_size=2, policy=StalenessPolicy(None), max_concurrent=100, max_groups=4)
    g.others["rival"] = (0, 0)
    assert g.try_start(10) == 4
    for _ in range(4):
        g.finish(True)
    assert g.capacity() == 0
    g.others["rival"] = (0, 1)  # the rival's learner dropped one: it needs one more
    assert g.try_start(10) == 1


def test_a_policy_with_all_its_groups_does_not_hold_back_one_that_needs_more():
    """The run's learner has its last groups (it trains no more): its bound no longer counts, so a listed policy
    whose learner went back (a restart) or dropped more still gets groups, under its own bound."""
    g = StalenessGate(batch_size=2, policy=StalenessPolicy(0), max_concurrent=100, max_groups=4)
    g.others["rival"] = (0, 0)
    g.version, g.accepted = 2, 4  # the run's learner is done: it holds all 4
    g.others["rival"] = (1, 2)  # the rival holds 2 (it dropped 2) at live version 1: its bound (1 + 0 + 1) * 2
    assert g.capacity() == 2
    g.others["rival"] = (1, 0)  # it holds all 4 too: nothing more for anyone
    assert g.capacity() == 0

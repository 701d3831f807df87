"""GroupOutcomes: a group's end is booked once, whichever message says it first."""

from __future__ import annotations

from arl.api.staleness import StalenessPolicy
from arl.controller.admission import Admission
from arl.controller.outcomes import GroupOutcomes
from arl.controller.reporting import ProgressWatch, Reporter
from arl.rollout.staleness import StalenessGate
from arl.transport import messages as m


def outcomes():
    admission = Admission(StalenessGate(batch_size=2, policy=StalenessPolicy(1), max_concurrent=8))
    refused: list[str] = []
    o = GroupOutcomes(admission, Reporter([], total_steps=4, progress=False), ProgressWatch(),
                      lambda kind, text: refused.append(kind))
    admission.open()
    assert admission.acquire(0, 2, "a0") == [(0, 2)]
    return o, admission, refused


def test_the_learners_receipt_then_the_workers_report_count_the_group_once():
    o, admission, refused = outcomes()
    assert o.received("w0.a0g1:0", 3)
    assert o.done(0, m.GroupDone(accepted=True, group_id="w0.a0g1:0", n_traj=3)) is not None
    assert admission.gate.accepted == 1 and admission.gate.running == 1 and refused == []


def test_a_learner_drop_of_no_group_of_this_run_is_refused_and_frees_no_budget():
    o, admission, refused = outcomes()
    assert o.dropped(m.GroupsDropped(n=1, reason="invalid", group_ids=["w9.ffg1:0"])) == []
    assert refused == ["unknown_group"] and admission.gate.running == 2


def test_a_group_done_for_no_running_group_is_refused():
    o, admission, refused = outcomes()
    assert o.done(3, m.GroupDone(accepted=True, group_id="w3.a3g1:0", n_traj=1)) is None
    assert refused == ["unexpected_group_done"]

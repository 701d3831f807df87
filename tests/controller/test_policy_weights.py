"""PolicyWeights: each trainable listed policy's versions on the inference servers (`docs/multi_policy.md`)."""

from __future__ import annotations

from arl.controller.policy_weights import PolicySend, PolicyWeights


def test_a_policy_version_goes_to_every_server_once_and_only_the_newest_to_one_still_loading():
    pw = PolicyWeights(["rival"], num_servers=2)
    assert pw.name(0) is None and pw.name(1) == "rival" and pw.name(2) is None
    assert pw.publish("rival", 1, "v1") == [PolicySend(0, "rival", 1, "v1"), PolicySend(1, "rival", 1, "v1")]
    assert pw.publish("rival", 2, "v2") == []  # both are loading v1: coalesced
    assert pw.publish("rival", 3, "v3") == []
    assert pw.live("rival") == 0
    assert pw.loaded("rival", 0, 1) == [PolicySend(0, "rival", 3, "v3")]  # the newest, skipping v2
    assert pw.loaded("rival", 1, 1) == [PolicySend(1, "rival", 3, "v3")]
    assert pw.live("rival") == 1 and pw.lowest_needed("rival") == 1
    assert pw.loaded("rival", 0, 3) == [] and pw.loaded("rival", 1, 3) == []
    assert pw.live("rival") == 3 and pw.lowest_needed("rival") == 3
    assert pw.publish("rival", 2, "old") == []  # never backwards
    assert pw.publish("nobody", 5, "x") == [] and pw.loaded("nobody", 0, 5) == []


def test_a_lost_server_does_not_hold_a_policy_back_and_a_restarted_one_gets_the_newest():
    pw = PolicyWeights(["a", "b"], num_servers=2)
    assert pw.publish("a", 1, "a1", lost={1}) == [PolicySend(0, "a", 1, "a1")]
    pw.loaded("a", 0, 1)
    assert pw.live("a", lost={1}) == 1 and pw.live("a") == 0
    # server 1 comes back holding every policy's initial adapter: the newest of each it lacks
    assert pw.registered(1) == [PolicySend(1, "a", 1, "a1")]
    assert pw.behind(3) == {"a": 1, "b": 0}
    assert pw.behind(1) == {"b": 0}
    assert pw.behind(1, {("learner", 1): {"version": 0}}) == {"a": 0, "b": 0}  # not in a heartbeat yet


def test_a_failed_load_is_sent_again_and_counted_and_drops_are_kept_per_policy():
    pw = PolicyWeights(["a"], num_servers=1)
    pw.publish("a", 1, "a1")
    assert pw.failed("a", 0) == ([PolicySend(0, "a", 1, "a1")], 1)
    assert pw.failed("a", 0)[1] == 2
    pw.loaded("a", 0, 1)
    assert pw.failures["a"] == [0]
    pw.dropped("a", 3)
    pw.dropped("nobody", 3)
    assert pw.drops == {"a": 3}


def test_the_books_of_each_policy_say_where_every_group_went():
    pw = PolicyWeights(["a"], num_servers=1)
    stats = {("learner", 1): {"version": 4, "groups_received": 10, "trained_groups": 8, "stale_groups_dropped": 1,
                              "buffered_groups": 1, "groups_without_policy": 2}}
    books = pw.accounting(stats)["a"]
    assert books["version"] == 4 and books["unaccounted"] == 0 and books["groups_without_policy"] == 2
    stats[("learner", 1)]["trained_groups"] = 7
    assert pw.accounting(stats)["a"]["unaccounted"] == 1


def test_a_placed_policy_is_sent_to_its_servers_only_and_live_there():
    pw = PolicyWeights(["a", "b"], num_servers=3, placement={"a": [1, 2]})
    assert pw.publish("a", 1, "a1") == [PolicySend(1, "a", 1, "a1"), PolicySend(2, "a", 1, "a1")]
    assert [s.server for s in pw.publish("b", 1, "b1")] == [0, 1, 2]
    assert pw.loaded("a", 0, 1) == []  # not its server: ignored
    pw.loaded("a", 1, 1)
    pw.loaded("a", 2, 1)
    assert pw.live("a") == 1 and pw.live("b") == 0
    assert [s.policy for s in pw.registered(0)] == ["b"]


def test_a_restarted_policy_learner_takes_every_server_back_to_its_checkpoint():
    pw = PolicyWeights(["a"], num_servers=2)
    pw.publish("a", 1, "a1")
    pw.loaded("a", 0, 1)
    pw.loaded("a", 1, 1)
    pw.publish("a", 2, "a2")
    pw.loaded("a", 0, 2)  # server 1 is still loading v2 when the learner dies
    assert pw.live("a") == 1
    # back from its checkpoint v1: both servers load v1 again, older than what server 0 has
    assert pw.restart("a", 1, "ckpt1") == [PolicySend(0, "a", 1, "ckpt1"), PolicySend(1, "a", 1, "ckpt1")]
    assert pw.loaded("a", 1, 2) == []  # the late ack of the lost learner's v2 is not taken
    pw.loaded("a", 0, 1)
    pw.loaded("a", 1, 1)
    assert pw.live("a") == 1 and pw.publish("a", 2, "new2") == [PolicySend(0, "a", 2, "new2"),
                                                                PolicySend(1, "a", 2, "new2")]

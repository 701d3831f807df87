"""DataPosition: the settled prompt positions of one stream, as a front plus the few settled above it."""

from __future__ import annotations

import json
import random

import pytest

from arl.data.position import DataPosition


def test_the_front_moves_over_dense_settlements_and_the_rest_stays_above():
    d = DataPosition()
    assert d.settle(1) and d.settle(3) and d.low == 0 and d.above == {1, 3}
    assert d.settle(0) and d.low == 2 and d.above == {3}  # 0 and 1 are dense now
    assert not d.settle(1) and not d.settle(3)  # settled twice: said so
    assert 0 in d and 3 in d and 2 not in d and 4 not in d and len(d) == 3
    assert d.next_fresh == 4 and list(d.unsettled(6)) == [2, 4, 5]
    assert d.to_state() == {"low": 2, "above": [3]}


def test_state_round_trips_through_json_in_any_settle_order():
    positions = list(range(500))
    random.Random(0).shuffle(positions)
    d = DataPosition()
    for p in positions[:400]:
        d.settle(p)
    back = DataPosition.from_state(json.loads(json.dumps(d.to_state())))
    assert back == d and set(range(500)) - set(d.unsettled(500)) == set(positions[:400])


def test_an_old_checkpoints_int_is_the_front():
    assert DataPosition.from_state(7) == DataPosition(7) and DataPosition(7).to_state() == {"low": 7, "above": []}


@pytest.mark.parametrize("bad", [True, "8", -1, {"above": []}, {"low": "1"}, {"low": 1, "above": [1.5]},
                                 {"low": 1, "above": 3}, [1, 2]])
def test_a_malformed_state_is_a_clear_error(bad):
    with pytest.raises(ValueError, match="data position"):
        DataPosition.from_state(bad)

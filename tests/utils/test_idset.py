"""CounterIdSet: exact set semantics at a bit per counter id, and its checkpoint form."""

from __future__ import annotations

import json
import random
import sys

from arl.utils.idset import CounterIdSet


def test_it_is_a_set_of_strings():
    rng = random.Random(0)
    ids = [f"w{rng.randrange(3)}.{rng.choice(['ab12', 'ff00'])}g{rng.randrange(5000)}" for _ in range(4000)]
    ids += ["custom-id", "g007", "x99999999999", "", "7"]  # leading zeros, too large, no counter: kept as strings
    s, ref = CounterIdSet(), set()
    for i in ids:
        assert s.add(i) == (i not in ref)
        ref.add(i)
    assert len(s) == len(ref) and set(s) == ref
    assert all(i in s for i in ref)
    probes = ["w0.ab12g5000", "w9.ab12g1", "g7", "g07", "custom", "w0.ab12g" + "1" * 12, 5]
    assert [p in s for p in probes] == [p in ref for p in probes]
    assert s.intersection(["w0.ab12g1", "nope", "g007"]) == {i for i in ["w0.ab12g1", "nope", "g007"] if i in ref}


def test_a_bit_per_group_not_a_string():
    s, ref = CounterIdSet(), set()
    for n in range(100_000):
        s.add(f"w0.3fa9c1g{n}")
        ref.add(f"w0.3fa9c1g{n}")
    assert s.nbytes() <= 2 * 100_000 // 8  # doubling leaves at most half unused
    strings = sys.getsizeof(ref) + sum(sys.getsizeof(i) for i in ref)
    assert strings > 100 * s.nbytes()


def test_checkpoint_form_round_trips_and_reads_the_old_list():
    s = CounterIdSet(["w0.a1g0", "w0.a1g2", "w1.b2g900", "odd-one"])
    state = json.loads(json.dumps(s.to_state()))
    back = CounterIdSet.from_state(state)
    assert set(back) == set(s) and len(back) == 4
    assert len(json.dumps(CounterIdSet(f"w0.a1g{n}" for n in range(50_000)).to_state())) < 200  # compressed
    assert set(CounterIdSet.from_state(["w0.t1g0", "x"])) == {"w0.t1g0", "x"}  # a checkpoint of the old form
    assert len(CounterIdSet.from_state(None)) == 0


def test_scattered_large_counters_stay_strings_not_a_bitmap_each():
    rng = random.Random(1)
    s = CounterIdSet()
    hostile = {f"w{i}.{rng.getrandbits(32):08x}g{rng.randrange(1 << 23, 1 << 24)}" for i in range(2000)}
    s.update(hostile)
    assert s.nbytes() == 0 and len(s) == len(hostile) and set(s) == hostile  # no 2000 bitmaps of ~2 MiB
    for n in range(20_000):  # a real worker's dense counters still go to its bitmap as they grow
        s.add(f"w0.ab12g{n}")
    assert s.nbytes() <= 2 * 20_000 // 8 + 8192 and len(s) == len(hostile) + 20_000
    assert "w0.ab12g19999" in s and "w0.ab12g20000" not in s
    s.add("w0.ab12g900000")  # far past the room: a string, still a member, counted once
    assert "w0.ab12g900000" in s and not s.add("w0.ab12g900000") and len(s) == len(hostile) + 20_001
    back = CounterIdSet.from_state(json.loads(json.dumps(s.to_state())))
    assert set(back) == set(s)

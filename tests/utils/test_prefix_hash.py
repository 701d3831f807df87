"""Prefix block hashes (the same in every process) and the block LRU the servers and the sim engine keep."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from arl.utils.prefix_hash import BlockLRU, as_hashes, prefix_hashes


def test_hash_names_each_prefix_and_changes_from_the_first_differing_block():
    ids = np.arange(100, dtype=np.int32)
    h = prefix_hashes(ids, 16)
    assert h.dtype == np.uint64 and len(h) == 6 and len(set(h.tolist())) == 6  # 100 // 16 whole blocks
    other = ids.copy()
    other[50] = 7  # in block 3
    assert (prefix_hashes(other, 16) == h).tolist() == [True, True, True, False, False, False]
    assert (prefix_hashes(ids[:64], 16) == h[:4]).all()  # a prefix's hashes are the longer sequence's first ones
    assert len(prefix_hashes(ids[:15], 16)) == 0
    swapped = ids.copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # order inside a block matters
    assert prefix_hashes(swapped, 16)[0] != h[0]
    assert (as_hashes(h.tobytes()) == h).all() and (as_hashes(h.tolist()) == h).all()


def test_extending_known_hashes_equals_hashing_the_whole():
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 32000, size=70, dtype=np.int32)
    whole = np.concatenate([prompt, rng.integers(0, 32000, size=45, dtype=np.int32)])
    known = prefix_hashes(prompt, 16)  # 4 blocks; the prompt's last 6 tokens are part of block 4 of `whole`
    assert (prefix_hashes(whole, 16, known) == prefix_hashes(whole, 16)).all()
    assert (prefix_hashes(prompt, 16, known) == known).all()  # nothing new
    assert (prefix_hashes(whole[:20], 16, known) == known[:1]).all()  # shorter than what is known
    assert len(prefix_hashes(whole[:10], 16, known)) == 0


def test_hashes_are_the_same_in_another_process():
    code = ("import numpy as np; from arl.utils.prefix_hash import prefix_hashes; "
            "print(prefix_hashes(np.arange(9000) % 32000, 64).tolist()[-1])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout
    assert int(out) == prefix_hashes(np.arange(9000) % 32000, 64).tolist()[-1]


def test_block_lru_matches_prefixes_and_evicts_the_deep_end_first():
    lru = BlockLRU(max_blocks=5, track=True)
    a = prefix_hashes(np.arange(48), 16)  # 3 blocks
    b = prefix_hashes(np.arange(100, 148), 16)
    assert lru.touch(a) == 3 and lru.match(a) == 3 and lru.match(b) == 0
    assert lru.touch(b) == 3 and len(lru) == 5  # one of a's went: its deepest (least recent)
    assert lru.match(a) == 2 and lru.match(b) == 3 and lru.evicted == 1
    longer = prefix_hashes(np.arange(80), 16)  # a's prefix + 2 blocks
    assert lru.match(longer) == 2
    added, dropped = lru.take_delta()
    assert len(added) == 5 and len(dropped) == 0  # a block added then evicted within one delta is in neither
    assert not lru.changed
    lru.clear()
    added, dropped = lru.take_delta()
    assert len(added) == 0 and sorted(dropped.tolist()) == sorted([*a[:2].tolist(), *b.tolist()])
    assert BlockLRU(0).touch(a) == 0

"""shared_prefix_groups: which decodes the varlen kernel attends to their shared blocks together.
(The kernel's numerics with groups are checked in test_cpu_decode_kernel.py.)"""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.attention.cascade import shared_prefix_groups

BS = 4


@st.composite
def steps(draw):
    """Sequences built on a random tree of shared block chains, as prefix caching shares them."""
    next_id = iter(range(10_000))
    chains = [[]]
    for _ in range(draw(st.integers(1, 6))):
        parent = draw(st.sampled_from(chains))
        chains.append(parent + [next(next_id) for _ in range(draw(st.integers(1, 8)))])
    tables, seq_lens, query_lens = [], [], []
    for _ in range(draw(st.integers(0, 30))):
        chain = draw(st.sampled_from(chains))
        own = draw(st.integers(1, 3 * BS))
        tables.append(chain + [next(next_id) for _ in range(-(-own // BS))])
        seq_lens.append(len(chain) * BS + own)
        query_lens.append(1 if draw(st.booleans()) or own < 2 else draw(st.integers(2, own)))
    width = max([len(t) for t in tables] + [1])
    padded = np.zeros((len(tables), width), np.int64)
    for i, t in enumerate(tables):
        padded[i, :len(t)] = t
    return padded, np.asarray(seq_lens, np.int64), np.asarray(query_lens, np.int64)


@settings(max_examples=300, deadline=None)
@given(steps(), st.integers(2, 5), st.integers(1, 4))
def test_groups_only_share_what_every_member_has(step, min_members, min_blocks):
    tables, seq_lens, query_lens = step
    g = shared_prefix_groups(tables, seq_lens, query_lens, BS, min_members, min_blocks)
    seen: set[int] = set()
    for i in range(g.num_groups):
        members = g.members[g.start[i]:g.start[i + 1]]
        blocks = int(g.prefix_len[i]) // BS
        assert g.prefix_len[i] % BS == 0 and blocks >= min_blocks and len(members) >= min_members
        assert not seen & set(members.tolist())
        seen |= set(members.tolist())
        for m in members:
            assert query_lens[m] == 1  # decodes only
            assert (tables[m, :blocks] == tables[members[0], :blocks]).all()
            assert g.prefix_len[i] <= seq_lens[m] - 1  # every shared key precedes the query


def test_all_share_one_prefix():
    tables = np.array([[7, 8, 9, 10, 20 + i] for i in range(5)])
    g = shared_prefix_groups(tables, np.full(5, 4 * BS + 2), np.ones(5, np.int64), BS, 4, 4)
    assert g.num_groups == 1 and g.prefix_len.tolist() == [4 * BS] and sorted(g.members.tolist()) == list(range(5))


def test_nested_sharing_prefers_the_larger_saving():
    # Eight decodes share 2 blocks; six of them share 10. Grouping the six over 10 blocks saves
    # 5 * 10 = 50 block reads, the eight over 2 saves only 7 * 2 = 14.
    rows = [[1, 2] + [100 + j for j in range(8)] + [200 + i] for i in range(6)]
    rows += [[1, 2, 300 + i, 0, 0, 0, 0, 0, 0, 0, 0] for i in range(2)]
    seq_lens = np.array([10 * BS + 1] * 6 + [3 * BS] * 2)
    g = shared_prefix_groups(np.array(rows), seq_lens, np.ones(8, np.int64), BS, 4, 2)
    assert g.prefix_len.tolist() == [10 * BS] and sorted(g.members.tolist()) == list(range(6))


def test_prefill_chunks_and_small_sharing_are_left_alone():
    tables = np.array([[7, 8, 9, 10, 20 + i] for i in range(5)])
    seq_lens = np.full(5, 4 * BS + 2)
    assert shared_prefix_groups(tables, seq_lens, np.full(5, 2), BS, 4, 4).num_groups == 0  # prefill chunks
    assert shared_prefix_groups(tables[:3], seq_lens[:3], np.ones(3, np.int64), BS, 4, 4).num_groups == 0

"""Shared-prefix groups for cascade attention.

When prefix caching lets many running requests share their first blocks (a system prompt, a
few-shot preamble, one document asked many questions), every decode step reads those same keys
once per request. Grouping the decodes whose block tables begin with the same physical blocks
lets the attention kernel stage each shared key chunk once for the whole group's query rows
(FlashInfer's cascade / "shared prefix" attention), then finish each request over its own keys.
Only the block tables are needed: equal block ids are equal keys.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np


class PrefixGroups(NamedTuple):
    start: np.ndarray  # [G + 1] int64: group i's members are members[start[i]:start[i + 1]]
    members: np.ndarray  # int64 sequence indices (decodes only), grouped
    prefix_len: np.ndarray  # [G] int64: keys every member of group i shares (whole blocks)

    @property
    def num_groups(self) -> int:
        return len(self.prefix_len)


NO_GROUPS = PrefixGroups(np.zeros(1, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))


def shared_prefix_groups(block_tables: np.ndarray, seq_lens: np.ndarray, query_lens: np.ndarray,
                         block_size: int, min_members: int = 4, min_blocks: int = 4) -> PrefixGroups:
    """Group the step's decodes (1-token chunks) by leading blocks they share.

    Each decode joins at most one group (the kernel resumes a request once from its group's
    state). Where sharing nests (40 requests on one document, two of them also sharing only its
    first blocks), the grouping that saves the most key reads wins: a group of n members over L
    blocks saves (n - 1) * L. A group needs `min_members` decodes over at least `min_blocks`
    blocks; smaller sharing stays on the per-sequence path, where the saved reads would not pay
    for the extra pass. The shared part stops before each member's last block (the one its new
    token is in), so every shared key precedes every member's query."""
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    decodes = np.nonzero(np.asarray(query_lens) == 1)[0]
    if len(decodes) < min_members or block_tables.shape[1] < min_blocks:
        return NO_GROUPS
    tables = block_tables[decodes]
    usable = (seq_lens[decodes] - 1) // block_size  # whole blocks before each member's query

    def best(rows: np.ndarray) -> tuple[int, list[tuple[np.ndarray, int]]]:
        """(blocks saved, groups) for decodes `rows` (indices into `decodes`), which share block 0."""
        cap = int(usable[rows].min())
        same = (tables[rows, :cap] == tables[rows[0], :cap]).all(axis=0)
        common = cap if same.all() else int(np.argmin(same))
        whole = (len(rows) - 1) * common if len(rows) >= min_members and common >= min_blocks else 0
        # Or: those that go deeper, split by their block at `common`, each subgroup on its own.
        deeper = rows[usable[rows] > common]
        split_saving, split_groups = 0, []
        if len(deeper) >= min_members:
            col = tables[deeper, common]
            order = np.argsort(col, kind="stable")
            for sub in np.split(deeper[order], np.flatnonzero(np.diff(col[order])) + 1):
                if len(sub) >= min_members:
                    saving, groups = best(sub)
                    split_saving += saving
                    split_groups += groups
        if whole >= split_saving and whole > 0:
            return whole, [(rows, common)]
        return split_saving, split_groups

    order = np.argsort(tables[:, 0], kind="stable")
    runs = np.split(order, np.flatnonzero(np.diff(tables[order, 0])) + 1)
    found = [g for run in runs if len(run) >= min_members for g in best(run)[1]]
    if not found:
        return NO_GROUPS
    starts = np.zeros(len(found) + 1, np.int64)
    np.cumsum([len(rows) for rows, _ in found], out=starts[1:])
    return PrefixGroups(starts, np.concatenate([decodes[rows] for rows, _ in found]).astype(np.int64),
                        np.asarray([common * block_size for _, common in found], np.int64))

"""Where one write's tokens go in a quantized cache, by block: blocks the write fills entirely
(quantized straight away) and blocks it fills only partly (through the residual pool). The same
for every layer of a step, so quantized.py works it out once per step and reuses it."""
from __future__ import annotations

from typing import NamedTuple

import torch


class Placement(NamedTuple):  # one write's tokens into whole blocks, or into partly written ones
    blocks: torch.Tensor  # the blocks
    rows: torch.Tensor | None  # the write's token rows that go there (None: all of them)
    index: torch.Tensor  # per token: its block's index in `blocks`
    offs: torch.Tensor  # per token: its slot in the block
    fresh: torch.Tensor | None  # per block (partly written): slot 0 written, a new occupant starts it
    # Whole blocks: the write's row for each slot of blocks x block_size, in order (a row gather
    # builds them; a scatter into a zeroed buffer cost several times more on CPU).
    source_rows: torch.Tensor | None = None


class WritePlan(NamedTuple):
    blocks: torch.Tensor  # every block the write touches
    whole: Placement | None
    part: Placement | None


def plan_write(slots: torch.Tensor, block_size: int) -> WritePlan:
    """The placement of tokens written to flat `slots` (block * block_size + offset)."""
    bs, device = block_size, slots.device
    blocks, offs = slots // bs, slots % bs
    ub, inv = torch.unique(blocks, return_inverse=True)
    cover = torch.zeros(ub.numel(), bs, dtype=torch.bool, device=device)
    cover[inv, offs] = True
    whole = cover.all(1)
    whole_plan = part_plan = None
    if bool(whole.any()):
        tok = whole[inv]
        widx = whole.long().cumsum(0) - 1
        rows, index, w_offs = tok.nonzero().flatten(), widx[inv[tok]], offs[tok]
        source = torch.empty(rows.numel(), dtype=torch.long, device=device)
        source[index * bs + w_offs] = rows  # every slot of a whole block is written exactly once
        whole_plan = Placement(ub[whole], rows, index, w_offs, None, source)
    part = ~whole
    if bool(part.any()):
        tok = part[inv]
        pidx = part.long().cumsum(0) - 1
        rows = None if whole_plan is None else tok.nonzero().flatten()  # None: every token
        part_plan = Placement(ub[part], rows, pidx[inv[tok]], offs[tok], cover[part, 0])
    return WritePlan(ub, whole_plan, part_plan)

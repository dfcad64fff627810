"""The one rule for comparing greedy outputs computed at bf16 precision, against transformers or
between two of kvserve's own paths.

Greedy decoding picks the larger of the top two logprobs, so what decides whether two forward
passes that differ in rounding (bf16 against float32, one kernel's summation order against
another's) pick the same token is how much their rounding moves the *gap* between the top two:
where the reference's gap is larger than any such move, both must pick the same token; where it
is smaller, either choice is right. A comparison states that bound D and checks three things:

1. closeness: wherever both runs have the same context (every position up to and including the
   first where they differ), the gap between the reference's top two tokens differs by at most D;
2. agreement: the tokens are identical up to the first position where they differ, and there the
   reference's own top-2 gap is below D (a near-tie); after it the contexts differ and nothing
   more is compared;
3. coverage: at least `min_compared` of all positions were compared, so that a bound too loose to
   say anything fails instead of passing.

D is never tuned per test to make it pass: against transformers it is measured in the test itself
(twice the largest move transformers' own bf16 forward makes to a float32 top-2 gap on the same
sequences); for kvserve's paths against each other it is the bound named at the call, and (1)
checks it where the runs share a context.
"""
from __future__ import annotations

from dataclasses import dataclass

Logprobs = dict[int, float]  # token id -> logprob at one position


@dataclass
class Run:
    tokens: list[int]
    logprobs: list[Logprobs]  # one dict per generated position (at least the top 2)


def run_of(completion) -> Run:
    """A kvserve CompletionOutput generated with logprobs >= 2."""
    return Run(list(completion.token_ids), [{t: lp.logprob for t, lp in d.items()} for d in completion.logprobs])


def _top2(lp: Logprobs) -> tuple[int, int]:
    a, b = sorted(lp, key=lp.get, reverse=True)[:2]
    return a, b


def _top2_gap(lp: Logprobs) -> float:
    a, b = _top2(lp)
    return lp[a] - lp[b]


def gap_move(run: Logprobs, reference: Logprobs) -> float | None:
    """How much `run` moves the gap between the reference's top two tokens (None: not both reported)."""
    a, b = _top2(reference)
    if a not in run or b not in run:
        return None
    return abs((run[a] - run[b]) - (reference[a] - reference[b]))


@dataclass
class Agreement:
    compared: int  # positions compared
    total: int
    max_move: float  # the largest top-2 gap move seen where contexts agree
    near_ties: int  # sequences that parted at a near-tie


def assert_greedy_agrees(got: list[Run], want: list[Run], bound: float, min_compared: float = 0.5,
                         what: str = "") -> Agreement:
    assert len(got) == len(want), (len(got), len(want))
    compared = total = near_ties = 0
    worst = 0.0
    for k, (g, w) in enumerate(zip(got, want)):
        n = min(len(g.tokens), len(w.tokens))
        total += n
        for i in range(n):
            move = gap_move(g.logprobs[i], w.logprobs[i])
            if move is not None:
                worst = max(worst, move)
                assert move <= bound, (f"{what} sequence {k} position {i}: the top-2 gap moved by {move:.3f} "
                                       f"> D = {bound:.3f} with the same context")
            if g.tokens[i] != w.tokens[i]:
                assert _top2_gap(w.logprobs[i]) < bound, (
                    f"{what} sequence {k} position {i}: {g.tokens[i]} != {w.tokens[i]} where the reference's "
                    f"top-2 gap {_top2_gap(w.logprobs[i]):.3f} >= D = {bound:.3f}")
                near_ties += 1
                break  # parted at a near-tie, where either choice is right: the contexts differ from here
            compared += 1
    assert compared >= min_compared * total, (f"{what}: only {compared} of {total} positions compared: "
                                              f"D = {bound:.3f} is too loose to say anything here")
    return Agreement(compared, total, worst, near_ties)


def assert_rows_agree(got: list[Logprobs], want: list[Logprobs], bound: float, min_compared: float = 0.5,
                      what: str = "") -> Agreement:
    """The rule for teacher-forced rows (the same context at every position, e.g. a prompt's
    logprobs): every top-2 gap moves by at most `bound`, and the top token is the reference's
    wherever the reference's gap is at least `bound`."""
    compared = worst = 0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        move = gap_move(g, w)
        assert move is not None, f"{what} row {i}: the reference's top two are not both in the row"
        worst = max(worst, move)
        assert move <= bound, f"{what} row {i}: the top-2 gap moved by {move:.3f} > D = {bound:.3f}"
        if _top2_gap(w) >= bound:
            assert _top2(g)[0] == _top2(w)[0], f"{what} row {i}: top token differs where the gap is {_top2_gap(w):.3f}"
            compared += 1
    assert compared >= min_compared * len(want), (f"{what}: only {compared} of {len(want)} rows compared: "
                                                  f"D = {bound:.3f} is too loose to say anything here")
    return Agreement(compared, len(want), worst, 0)


def bf16_bound(hf_fp32, sequences: list[list[int]], positions: list[range], top: int = 20) -> float:
    """D for these sequences: twice the largest move transformers' own bf16 forward makes to a
    float32 top-2 gap at `positions` (rows predicting those tokens)."""
    import copy

    import torch
    hf_bf16 = copy.deepcopy(hf_fp32).to(torch.bfloat16)
    worst = 0.0
    with torch.no_grad():
        for seq, rows in zip(sequences, positions):
            ids = torch.tensor([seq])
            lp32 = torch.log_softmax(hf_fp32(ids).logits[0].float(), -1)
            lp16 = torch.log_softmax(hf_bf16(ids).logits[0].float(), -1)
            for r in rows:
                idx = lp32[r].topk(top).indices.tolist()
                move = gap_move({t: lp16[r, t].item() for t in idx}, {t: lp32[r, t].item() for t in idx})
                worst = max(worst, move)
    return 2 * worst


# Natural text for prompts: greedy decoding after random token ids is a run of near-ties, which
# says little about whether two paths agree.
TEXT = """For most of recorded history, a ship approaching land at night was in greater danger than a ship
alone in the middle of the ocean. The open sea is wide and forgiving; a vessel can drift for days
without touching anything harder than water. The coast is another matter. Rocks lie a few feet below
the surface, sandbars move with every winter storm, and headlands that look distant in daylight can
appear suddenly out of fog. Sailors of the ancient Mediterranean learned to hug the shore by day and
to anchor or stand far out by night. They read the colour of the water, the flight of birds, and the
smell of vegetation carried on an offshore breeze. None of these signs worked well in the dark.

The earliest lights were simply fires. A community that depended on trade would pile wood on a hill
above its harbour and keep it burning through the night, partly as a welcome and partly as a
warning. Such fires were expensive. A large blaze consumed an astonishing amount of fuel, and
someone had to stay awake to feed it. The fire also had to be placed with care. A light on the wrong
headland could lure a captain into the very bay he most wished to avoid, and there are old stories,
some of them probably true, of wreckers who lit false fires in order to plunder the cargo that
washed ashore.

The famous tower at Alexandria, built in the third century before the common era, showed what a
determined state could do. Accounts written long after its construction describe a structure of
several stages, square at the bottom, octagonal in the middle and round at the top, with a fire
burning at its summit. Travellers claimed that its light could be seen from a great distance,
although the numbers they gave grew larger with each retelling. What matters more than the exact
height is the idea that the tower represented: a permanent, public investment in the safety of
strangers. The ships that benefited were not owned by the builders. Many of them came from other
cities and other kingdoms. The light served anyone who happened to be at sea.

For centuries after Alexandria, progress was slow. Coal replaced wood in some places, because it
burned longer and gave a steadier flame, but an open coal fire on top of a tower was a smoky,
unreliable thing. Rain could quench it, wind could blow it sideways, and the keepers spent much of
the night shovelling. Candles were tried inside glazed lanterns, which protected the flame but
produced very little light. A chandelier of two dozen candles, burning behind glass that quickly
blackened with soot, might be visible for only a few miles."""


def text_prompts(tokenizer, lengths, seed: int = 0) -> list[list[int]]:
    """Windows of TEXT's tokens of the given lengths, at offsets drawn with `seed`."""
    import random
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    rng = random.Random(seed)
    return [ids[(o := rng.randrange(len(ids) - n)):o + n] for n in lengths]

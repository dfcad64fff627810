"""Sampler: masks, penalties, min_tokens, seeds and logprobs on hand-built logits."""
from __future__ import annotations

import math

import pytest
import torch

from kvserve.core.sampling_params import SamplingParams
from kvserve.runner.sampler import Sampler, SamplingRow, apply_min_p, apply_penalties, apply_top_k_top_p

NEG = float("-inf")


def row(params: SamplingParams, rid: str = "r", prompt=(), output=(), eos=()) -> SamplingRow:
    return SamplingRow(rid, params, list(prompt), list(output), frozenset(eos))


def kept(logits: torch.Tensor) -> list[int]:
    return torch.nonzero(torch.isfinite(logits[0]))[:, 0].tolist()


def test_top_k_keeps_k_largest_and_ties_with_the_kth():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0, 0.0]])
    one = torch.ones(1)
    assert kept(apply_top_k_top_p(logits, torch.tensor([2]), one)) == [1, 3]
    assert kept(apply_top_k_top_p(logits, torch.tensor([3]), one)) == [1, 2, 3]
    assert kept(apply_top_k_top_p(logits, torch.tensor([6]), one)) == list(range(6))
    ties = torch.tensor([[5.0, 1.0, 5.0, 0.0]])
    assert kept(apply_top_k_top_p(ties, torch.tensor([1]), one)) == [0, 2]
    # kept values are unchanged
    out = apply_top_k_top_p(logits, torch.tensor([2]), one)
    assert out[0, 1] == 5.0 and out[0, 3] == 4.0


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.25, 0.5, 0.1, 0.15]]))
    k_off = torch.tensor([4])
    assert kept(apply_top_k_top_p(logits, k_off, torch.tensor([0.7]))) == [0, 1]  # 0.75 >= 0.7
    assert kept(apply_top_k_top_p(logits, k_off, torch.tensor([0.8]))) == [0, 1, 3]  # 0.9 >= 0.8
    assert kept(apply_top_k_top_p(logits, k_off, torch.tensor([0.4]))) == [1]
    assert kept(apply_top_k_top_p(logits, k_off, torch.tensor([1e-6]))) == [1]  # top token survives
    # per-row parameters in one call
    both = apply_top_k_top_p(logits.repeat(2, 1), torch.tensor([1, 4]), torch.tensor([1.0, 0.8]))
    assert kept(both[:1]) == [1] and kept(both[1:]) == [0, 1, 3]


def test_min_p_drops_tokens_below_fraction_of_top():
    logits = torch.log(torch.tensor([[0.25, 0.5, 0.1, 0.15], [0.25, 0.5, 0.1, 0.15]]))
    apply_min_p(logits, torch.tensor([0.4, 0.25]))  # thresholds 0.2 and 0.125
    assert kept(logits[:1]) == [0, 1] and kept(logits[1:]) == [0, 1, 3]


def test_sampled_distribution_follows_masks():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    n = 4000
    logits = probs.log().repeat(n, 1)
    sampler = Sampler(seed=1)
    toks = [t.token_id for t in sampler(logits, [row(SamplingParams(top_k=2))] * n)]
    freq = torch.bincount(torch.tensor(toks), minlength=4).float() / n
    assert freq[2:].sum() == 0
    assert abs(freq[0] - 0.4 / 0.7) < 0.03
    toks = [t.token_id for t in sampler(logits, [row(SamplingParams(temperature=0.5))] * n)]
    sharpened = probs ** 2 / (probs ** 2).sum()  # T=0.5 squares the probabilities
    freq = torch.bincount(torch.tensor(toks), minlength=4).float() / n
    assert (freq - sharpened).abs().max() < 0.03


def test_repetition_frequency_presence_penalties_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.3)
    apply_penalties(logits, [row(params, prompt=[0, 4], output=[2, 2, 3])])
    # 0: prompt, positive -> 2.0/2; 1: unseen; 2: 0.5/2 - 2*0.5 - 0.3; 3: 3.0/2 - 0.5 - 0.3;
    # 4: prompt, negative -> -2.0*2 (frequency/presence count output ids only)
    expected = torch.tensor([[1.0, -1.0, 0.25 - 1.0 - 0.3, 1.5 - 0.5 - 0.3, -4.0]])
    torch.testing.assert_close(logits, expected)


def test_penalties_apply_per_row_and_change_greedy_choice():
    logits = torch.tensor([[1.0, 3.0, 2.9, 0.0]] * 2)
    greedy_pen = SamplingParams(temperature=0.0, presence_penalty=0.5)
    greedy = SamplingParams(temperature=0.0)
    out = Sampler()(logits, [row(greedy_pen, "a", output=[1]), row(greedy, "b", output=[1])])
    assert [t.token_id for t in out] == [2, 1]


def test_greedy_is_argmax_after_penalties_and_ignores_top_k():
    logits = torch.tensor([[0.1, 0.7, 0.3], [2.0, 1.0, 3.0]])
    params = SamplingParams(temperature=1e-6, top_k=1, top_p=0.1)
    assert [t.token_id for t in Sampler()(logits, [row(params), row(params)])] == [1, 2]


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 2.0, 5.0, 4.0]])
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4])
    sampler = Sampler()
    assert sampler(logits, [row(params, output=[1, 1], eos=[3])])[0].token_id == 2
    assert sampler(logits, [row(params, output=[1, 1, 1], eos=[3])])[0].token_id == 3
    no_min = SamplingParams(temperature=0.0, stop_token_ids=[4])
    assert sampler(logits, [row(no_min, eos=[3])])[0].token_id == 3


def draws(sampler: Sampler, rid: str, seed: int, logits: torch.Tensor, neighbours: int, where: int) -> list[int]:
    """Five steps of one seeded request placed among unseeded / differently seeded neighbours."""
    got = []
    for step in range(5):
        rows = [row(SamplingParams(seed=100 + i if i % 2 else None), f"n{i}") for i in range(neighbours)]
        rows.insert(where, row(SamplingParams(seed=seed, top_p=0.9), rid))
        out = sampler(logits.repeat(len(rows), 1), rows)
        got.append(out[where].token_id)
    return got


def test_seeded_request_reproducible_regardless_of_batch():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0)) * 0.1  # high entropy
    alone = draws(Sampler(seed=0), "x", 7, logits, neighbours=0, where=0)
    crowded = draws(Sampler(seed=99), "x", 7, logits, neighbours=5, where=3)
    assert alone == crowded
    assert draws(Sampler(seed=0), "x", 8, logits, neighbours=0, where=0) != alone
    # the generator persists across steps: five draws are not five first draws
    assert len(set(alone)) > 1
    sampler = Sampler()
    first = draws(sampler, "x", 7, logits, 0, 0)
    sampler.forget(["x"])  # a finished request's generator is dropped; the id starts afresh
    assert draws(sampler, "x", 7, logits, 0, 0) == first


def test_unseeded_requests_follow_the_engine_seed():
    logits = torch.zeros(3, 500)
    params = [row(SamplingParams(), f"r{i}") for i in range(3)]
    a = [t.token_id for t in Sampler(seed=5)(logits, params)]
    assert a == [t.token_id for t in Sampler(seed=5)(logits, params)]
    assert a != [t.token_id for t in Sampler(seed=6)(logits, params)]


def test_logprobs_are_raw_log_softmax():
    logits = torch.tensor([[1.0, 2.0, 0.5, 3.0, -1.0], [0.0, 0.0, 4.0, 1.0, 1.0]])
    raw = torch.log_softmax(logits, -1)
    rows = [row(SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=2.0), prompt=[3]),
            row(SamplingParams(temperature=0.7, logprobs=0, seed=3))]
    out = Sampler()(logits, rows)
    a, b = out
    assert a.token_id == 1  # the penalty moved the choice, but logprobs stay those of the model
    assert math.isclose(a.logprob, raw[0, 1].item(), rel_tol=1e-6)
    assert a.top_logprobs.keys() == {3, 1}
    assert math.isclose(a.top_logprobs[3], raw[0, 3].item(), rel_tol=1e-6)
    assert list(a.top_logprobs) == [3, 1] and a.rank == 2  # best first; token 1 is second
    assert b.rank == int((raw[1] >= raw[1, b.token_id]).sum())  # vLLM's: tokens at least as likely
    assert b.top_logprobs is None and math.isclose(b.logprob, raw[1, b.token_id].item(), rel_tol=1e-6)
    plain = Sampler()(logits[:1], [row(SamplingParams())])[0]
    assert plain.logprob is None and plain.top_logprobs is None


def test_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="2 logits rows for 1 sampling rows"):
        Sampler()(torch.zeros(2, 4), [row(SamplingParams())])
    assert Sampler()(torch.zeros(0, 4), []) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_callers_logits_stay_intact(dtype):
    """Bans and penalties must edit a copy, never the caller's tensor (the lm_head's output, or a
    buffer a caller reuses step to step); plain greedy rows need no copy at all."""
    logits = torch.randn(3, 10).to(dtype)
    before = logits.clone()
    rows = [row(SamplingParams(temperature=0.0, min_tokens=5), "a", output=[1], eos=[2]),
            row(SamplingParams(temperature=0.0, repetition_penalty=1.5), "b", output=[3]),
            row(SamplingParams(temperature=0.0), "c")]
    out = Sampler()(logits, rows)
    assert torch.equal(logits, before)
    assert out[0].token_id != 2
    assert out[2].token_id == int(before[2].float().argmax())


def test_row_argmax_matches_torch_including_ties_and_nan():
    from kvserve.runner.sampler import row_argmax
    x = torch.randn(7, 1000)
    x[1, [5, 9]] = 50.0  # tie: the first one wins
    x[2, [3, 800]] = float("nan")  # NaN: the first NaN, as torch does
    x[3, [4, 6]] = float("inf")
    for t in (x, x[::2], x.T.contiguous().T, x.bfloat16(), x.bfloat16()[1::2]):
        assert torch.equal(row_argmax(t), t.argmax(-1))
        assert row_argmax(t).dtype == torch.int64


@pytest.mark.needs("avx512_bf16")
def test_bf16_row_argmax_is_numpys_on_the_float32_copy():
    """Greedy steps take the argmax of the bf16 logits as the lm_head wrote them
    (csrc/argmax_bf16.cpp): the answer numpy gives on their float32 copy, at every row width
    (the kernel reads 16 at a time), with ties, -inf rows, NaN and many rows (threads)."""
    from kvserve.ops.cpu_kernels import argmax_bf16_kernel
    from kvserve.runner.sampler import row_argmax
    assert argmax_bf16_kernel() is not None
    g = torch.Generator().manual_seed(0)
    for cols in (1, 15, 16, 17, 33, 1000, 49152):
        x = torch.randn(9, cols, generator=g).bfloat16()  # bf16 makes ties common at 49,152
        x[1] = float("-inf")
        x[2, cols // 2] = float("nan")
        x[3, -1] = 100.0  # the maximum in the last (tail) lane
        x[4, :] = 1.0  # all tied: index 0
        want = torch.from_numpy(x.float().numpy().argmax(axis=1))
        assert torch.equal(row_argmax(x), want), cols
    big = torch.randn(64, 49152, generator=g).bfloat16()
    assert torch.equal(row_argmax(big), torch.from_numpy(big.float().numpy().argmax(axis=1)))


def test_greedy_rows_of_bf16_logits_sample_as_their_float32_copy():
    """The runner hands the sampler the lm_head's bf16 logits: plain greedy batches take the
    argmax of those rows, batches with logprobs / penalties / draws convert them to float32
    first; either way each token is the one float32 logits give."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1)).bfloat16()
    greedy = [row(SamplingParams(temperature=0.0), f"g{i}") for i in range(4)]
    ref = Sampler()(logits.float(), greedy)
    assert [t.token_id for t in Sampler()(logits, greedy)] == [t.token_id for t in ref]
    mixed = greedy[:3] + [row(SamplingParams(temperature=0.0, logprobs=2), "lp")]
    ours, theirs = Sampler()(logits, mixed), Sampler()(logits.float(), mixed)
    assert ours == theirs
    assert ours[3].logprob is not None

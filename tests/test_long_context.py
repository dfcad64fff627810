"""Long contexts in bounded memory: blocks a sliding window or KV compression puts out of reach
leave the sequence, outputs stay exact where they should (sliding window, neighbours of a
compressed request), and no block leaks."""
from __future__ import annotations

import pytest
import torch
from helpers import greedy, rand_prompts
from hf_reference import hf_greedy, load_hf
from tiny_models import make_tiny_model

from kvserve import LLM, SamplingParams
from kvserve.core.kv_compression import KVCompression, parse_kv_compression
from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParamsError
from kvserve.engine.outputs import RequestError
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.release import blocks_to_release

BS = 16


@pytest.fixture(scope="module")
def swa(tmp_path_factory):
    path = make_tiny_model(tmp_path_factory.mktemp("swa32"), kind="mistral_swa32")
    return str(path), load_hf(path)


def run_steps(llm, prompts, params, bound=None):
    """Drive the engine step by step; every step checks the pool and, with `bound`, that no
    sequence holds more than `bound` blocks. Returns outputs by request id, in order."""
    eng = llm.engine
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params[i] if isinstance(params, list) else params)
    outs = {}
    peak = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        eng.kv.check_integrity()
        held = max((len(b) for b in eng.kv.req_blocks.values()), default=0)
        peak = max(peak, held)
        if bound is not None:
            assert held <= bound, f"a sequence holds {held} blocks, bound {bound}"
    assert eng.kv.pool.num_used_blocks == 0
    return [outs[str(i)] for i in range(len(prompts))], peak


# -- sliding window ---------------------------------------------------------------------------

def test_sliding_window_releases_blocks_and_stays_exact(swa):
    path, hf = swa
    # chunks of 32 tokens: the prompt's own chunked prefill releases blocks as it goes
    llm = LLM(path, dtype="float32", block_size=BS, max_num_batched_tokens=32, kv_cache_memory=16 * 2**20)
    vocab = llm.engine.model_config.vocab_size
    prompts = rand_prompts(7, [5, 40, 150], vocab)
    n = 90  # well past the window of 32
    # window 32 + one block, plus the blocks a 32-token chunk writes before the step commits
    outs, peak = run_steps(llm, prompts, greedy(n), bound=32 // BS + 1 + 32 // BS)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, n), f"prompt of {len(p)} tokens diverged"
    released = llm.engine.kv.num_released["sliding_window"]
    assert released >= sum((len(p) + n - 1 - 32) // BS for p in prompts), released
    # The same prompts again: the prefix cache serves them from the window's blocks alone.
    again, _ = run_steps(llm, prompts[1:], greedy(n), bound=32 // BS + 1 + 32 // BS)
    assert [o.num_cached_tokens for o in again] == [39, 149]  # full blocks, then copy-on-write
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs[1:]]


def test_window_hit_skips_evicted_blocks():
    """vLLM's sliding-window prefix caching: a hit needs only the blocks its next token sees."""
    kv = KVCacheManager(24, BS, sliding_window=32)
    a = Request("a", list(range(1000, 1160)), SamplingParams())  # 10 blocks
    hit = kv.get_computed_blocks(a)
    assert kv.allocate_slots(a, a.num_tokens, hit)
    a.num_computed_tokens = a.num_tokens
    kv.commit(a)
    assert len(kv.req_blocks["a"]) == 2 and kv.released_tokens(a) == 8 * BS
    kv.check_integrity()
    kv.forget(a)
    for i in range(14):  # take every empty block, then the 8 oldest cached: a's released ones
        kv.pool.allocate()
    b = Request("b", a.prompt_token_ids + [7], SamplingParams())
    hit = kv.get_computed_blocks(b)
    assert (hit.num_tokens, hit.num_skipped, len(hit.blocks)) == (160, 8, 2)
    # and the plain search (no window) would find nothing at all
    assert KVCacheManager(24, BS).get_computed_blocks(b).num_tokens == 0


# -- compression policies (no torch) -------------------------------------------------------------

def test_release_policies():
    s = KVCompression("streaming", window=32, sink_tokens=4)
    held = list(range(10))  # blocks 0..9, next token at 160
    assert blocks_to_release("streaming", held, 160, BS, s, None) == [1, 2, 3, 4, 5, 6, 7]
    h = KVCompression("h2o", window=32, heavy_tokens=32)
    scores = [5.0, 1.0, 9.0, 0.5, 3.0, 2.0, 7.0, 0.0, 0.0, 0.0]
    # 8 blocks older than the window compete for 2 places: 2 and 6 stay
    assert blocks_to_release("h2o", held, 160, BS, h, None, scores) == [0, 1, 3, 4, 5, 7]
    assert blocks_to_release("sliding_window", held, 160, BS, None, 32) == list(range(8))
    k = KVCompression("snapkv", window=32, sink_tokens=4, heavy_tokens=32, observation_tokens=8)
    # a 150-token prompt: nothing goes before the vote, which comes with its last chunk
    assert blocks_to_release("snapkv", held, 128, BS, k, None, scores, prompt_len=150) == []
    # at the vote (next token 150): blocks 1..6 (before the window at 150) compete for 2 places
    # beside the sink block; 2 and 6 win
    assert blocks_to_release("snapkv", held, 150, BS, k, None, scores, prompt_len=150) == [1, 3, 4, 5]
    # decoding on: the chosen stay, the blocks the window leaves go as in streaming
    chosen = [0, 2, 6, 7, 8, 9, 10, 11]
    assert blocks_to_release("snapkv", chosen, 200, BS, k, None, [0.0] * 8, prompt_len=150) == [3, 4, 5]


def test_methods_score_the_rows_they_need():
    from kvserve.kv.compression import method_for
    from kvserve.kv.compression.h2o import PROMPT_ROW_STRIDE
    h = method_for(KVCompression("h2o", window=32, heavy_tokens=32))
    assert h.score_rows(100, 1, 50) == (1, 1)  # every decode query
    assert h.score_rows(0, 64, 200) == (64, PROMPT_ROW_STRIDE)  # a sample of a prompt chunk's
    k = method_for(KVCompression("snapkv", window=32, sink_tokens=4, heavy_tokens=32, observation_tokens=8))
    assert k.score_rows(0, 64, 200) is None  # not the prompt's last chunk
    assert k.score_rows(192, 8, 200) == (8, 1) and k.score_rows(196, 4, 200) == (4, 1)
    assert k.score_rows(200, 1, 200) is None  # decodes: no scores
    assert method_for(KVCompression("streaming", window=32, sink_tokens=4)).score_rows(0, 64, 200) is None


@pytest.mark.parametrize("value, field", [
    ({"method": "snap"}, "kv_compression.method"),
    ({"method": "streaming", "window": 0}, "kv_compression.window"),
    ({"method": "streaming", "window": 64, "sink_tokens": -1}, "kv_compression.sink_tokens"),
    ({"method": "h2o", "window": 64}, "kv_compression.heavy_tokens"),
    ({"method": "snapkv", "window": 64, "heavy_tokens": 64, "observation_tokens": 0},
     "kv_compression.observation_tokens"),
    ({"method": "snapkv", "window": 64}, "kv_compression.heavy_tokens"),
    ({"method": "streaming", "window": 64, "heavy_tokens": 3}, "kv_compression"),
    ("streaming", "kv_compression"),
])
def test_bad_compression_names_the_field(value, field):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(kv_compression=value)
    assert str(e.value).split()[0] == field, str(e.value)


def test_none_opts_out():
    assert parse_kv_compression({"method": "none"}).method == "none"
    assert parse_kv_compression(None) is None


# -- streaming on the engine ------------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny, dtype="float32", block_size=BS, max_num_batched_tokens=64, kv_cache_memory=16 * 2**20,
               max_model_len=512)


@torch.no_grad()
def hf_streaming(model, prompt, n, window, sinks):
    """transformers decoding with the keys streaming has released masked out, at their original
    positions: the reference for block-granular StreamingLLM (no release inside the prompt)."""
    sink_blocks = -(-sinks // BS)
    ids = torch.tensor([prompt])
    out = model(input_ids=ids, use_cache=True)
    past, tokens = out.past_key_values, []
    for _ in range(n):
        nxt = int(out.logits[0, -1].argmax())
        tokens.append(nxt)
        q = len(prompt) + len(tokens) - 1
        # released after the step that computed q - 1: blocks past the sinks ending at or before q - window
        keep = [1 if k // BS < sink_blocks or (k // BS + 1) * BS > q - window else 0 for k in range(q + 1)]
        out = model(input_ids=torch.tensor([[nxt]]), past_key_values=past, use_cache=True,
                    attention_mask=torch.tensor([keep]), position_ids=torch.tensor([[q]]))
        past = out.past_key_values
    return tokens


def test_streaming_matches_masked_reference_and_spares_neighbours(llm, tiny_hf):
    vocab = llm.engine.model_config.vocab_size
    comp = {"method": "streaming", "sink_tokens": 4, "window": 32}
    prompts = rand_prompts(11, [20, 45, 70], vocab)
    n = 100
    alone, _ = run_steps(llm, prompts[1:], greedy(n))
    # the compressed one holds at most 1 sink block + the window's 2 blocks + 1 being written
    mixed, _ = run_steps(llm, prompts, [greedy(n, kv_compression=comp), greedy(n), greedy(n)])
    assert [o.outputs[0].token_ids for o in mixed[1:]] == [o.outputs[0].token_ids for o in alone]
    assert mixed[0].outputs[0].token_ids == hf_streaming(tiny_hf, prompts[0], n, 32, 4)
    attended = mixed[0].outputs[0].num_attended_tokens
    assert attended is not None and attended <= 16 + 32 + 16, attended
    assert mixed[1].outputs[0].num_attended_tokens is None
    assert llm.engine.kv.num_released["streaming"] > 0


def test_compressed_state_is_never_served_to_others(llm):
    """Blocks a compressed sequence computes after its first release are not published: the same
    prompt, uncompressed, gets only the exact prefix from the cache and the uncompressed output."""
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    prompt = rand_prompts(12, [200], vocab)[0]
    comp = {"method": "streaming", "sink_tokens": 4, "window": 32}
    assert eng.reset_prefix_cache()
    compressed, _ = run_steps(llm, [prompt], [greedy(40, kv_compression=comp)])
    full_text = prompt + compressed[0].outputs[0].token_ids
    # the first chunk (64 tokens, 4 blocks) was computed before any release: exact, shared
    again, _ = run_steps(llm, [full_text[:180]], [greedy(8)])
    assert again[0].num_cached_tokens == 64
    eng.reset_prefix_cache()
    fresh, _ = run_steps(llm, [full_text[:180]], [greedy(8)])
    assert again[0].outputs[0].token_ids == fresh[0].outputs[0].token_ids


def test_compression_refused_where_it_cannot_run(llm, swa):
    with pytest.raises(RequestError) as e:
        llm.engine.add_request("big", [1, 2, 3], greedy(4, kv_compression={"method": "streaming", "window": 600}))
    assert e.value.param == "kv_compression"
    swa_llm = LLM(swa[0], dtype="float32", block_size=BS, kv_cache_memory=8 * 2**20)
    with pytest.raises(RequestError) as e:
        swa_llm.engine.add_request("w", [1, 2, 3], greedy(4, kv_compression={"method": "streaming", "window": 64}))
    assert e.value.param == "kv_compression" and "sliding" in str(e.value)


def test_released_blocks_reach_the_metrics(llm):
    from prometheus_client import generate_latest
    from server_util import parse_metrics

    from kvserve.server.metrics import ServerMetrics
    vocab = llm.engine.model_config.vocab_size
    run_steps(llm, rand_prompts(13, [30], vocab), [greedy(60, kv_compression={"method": "streaming", "window": 16})])
    stats = llm.engine.get_stats()
    assert stats.kv_released_blocks["streaming"] >= 3
    m = ServerMetrics("m", 512)
    m.observe_stats(stats)
    s = parse_metrics(generate_latest(m.registry).decode())
    assert s['kvserve:kv_released_blocks_total{engine="0",model_name="m",reason="streaming"}'] == stats.kv_released_blocks["streaming"]


def test_server_default_and_opt_out(tiny):
    llm = LLM(tiny, dtype="float32", block_size=BS, kv_cache_memory=8 * 2**20, max_model_len=256,
              kv_compression='{"method": "streaming", "sink_tokens": 4, "window": 32}')
    vocab = llm.engine.model_config.vocab_size
    p = rand_prompts(14, [20], vocab)
    default, _ = run_steps(llm, p + p, [greedy(60), greedy(60, kv_compression={"method": "none"})])
    assert default[0].outputs[0].num_attended_tokens is not None
    assert default[1].outputs[0].num_attended_tokens is None
    from kvserve.config import ConfigError
    with pytest.raises(ConfigError, match="kv-compression"):
        LLM(tiny, dtype="float32", block_size=BS, kv_cache_memory=8 * 2**20, max_model_len=256,
            kv_compression='{"method": "streaming", "window": 300}')


def test_h2o_scores_bound_and_spare_neighbours(llm):
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    comp = {"method": "h2o", "heavy_tokens": 32, "window": 32}
    prompts = rand_prompts(15, [20, 45, 70], vocab)
    seen = []
    add = eng.kv.add_scores
    eng.kv.add_scores = lambda req, scores: (seen.append((req.num_computed_tokens, sum(scores))), add(req, scores))
    try:
        alone, _ = run_steps(llm, prompts[1:], greedy(100))
        assert not seen  # nobody asked: no scores computed
        mixed, _ = run_steps(llm, prompts, [greedy(100, kv_compression=comp), greedy(100), greedy(100)])
    finally:
        eng.kv.add_scores = add
    assert [o.outputs[0].token_ids for o in mixed[1:]] == [o.outputs[0].token_ids for o in alone]
    # every query's softmax sums to 1 in each head of each layer: 4 heads x 3 layers per query;
    # the 20-token prompt is scored by rows 19, 11 and 3, each counted 8 times
    heads_layers = eng.model_config.num_attention_heads * eng.model_config.num_hidden_layers
    assert seen[0] == (20, pytest.approx(24 * heads_layers, rel=1e-4))
    assert all(s == pytest.approx(heads_layers, rel=1e-4) for _, s in seen[1:]), seen[:8]
    # 2 heavy blocks + the window's 2-3 blocks (+ the one being written)
    assert mixed[0].outputs[0].num_attended_tokens <= 32 + 32 + 2 * BS
    assert eng.kv.num_released["h2o"] > 0


def test_snapkv_votes_once_bounds_and_spares_neighbours(llm):
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    comp = {"method": "snapkv", "sink_tokens": 4, "heavy_tokens": 32, "window": 32, "observation_tokens": 8}
    prompts = rand_prompts(17, [150, 45, 70], vocab)
    seen = []
    add = eng.kv.add_scores
    eng.kv.add_scores = lambda req, scores: (seen.append((req.num_computed_tokens, sum(scores))), add(req, scores))
    try:
        alone, _ = run_steps(llm, prompts[1:], greedy(60))
        mixed, _ = run_steps(llm, prompts, [greedy(60, kv_compression=comp), greedy(60), greedy(60)])
    finally:
        eng.kv.add_scores = add
    assert [o.outputs[0].token_ids for o in mixed[1:]] == [o.outputs[0].token_ids for o in alone]
    # one vote, by the prompt's last 8 queries (chunks of 64: the last one is 22 tokens)
    heads_layers = eng.model_config.num_attention_heads * eng.model_config.num_hidden_layers
    assert seen == [(150, pytest.approx(8 * heads_layers, rel=1e-4))]
    # 1 sink block + 2 chosen + the window's 2-3 blocks
    assert mixed[0].outputs[0].num_attended_tokens <= 16 + 32 + 32 + 2 * BS
    assert eng.kv.num_released["snapkv"] > 0


@pytest.mark.needs("avx512_bf16")
def test_scores_stay_in_the_compiled_layer_loop(tmp_path):
    """bf16 on CPU: a step with h2o or snapkv requests stays one compiled call (the scores come
    from csrc/score_blocks_bf16.cpp inside it), and gives the scores the Python loop's torch
    computation gives, and the same tokens, for the compressed requests and their neighbours."""
    path = str(make_tiny_model(tmp_path, kind="llama_d64"))
    prompts = rand_prompts(18, [150, 45, 70, 90], 49152)
    comps = [{"method": "h2o", "heavy_tokens": 32, "window": 32},
             {"method": "snapkv", "sink_tokens": 4, "heavy_tokens": 32, "window": 32, "observation_tokens": 8}]
    runs = []
    for compiled in (True, False):
        llm = LLM(path, dtype="bfloat16", block_size=BS, max_num_batched_tokens=64, kv_cache_memory=16 * 2**20,
                  enable_prefix_caching=False)
        eng, model = llm.engine, llm.engine.runner.model
        model.use_compiled_decoder = compiled
        if compiled:
            def no_python_scores(*a):
                raise AssertionError("scores left the compiled layer loop")
            model.attn.score_blocks = no_python_scores
        seen = []
        add = eng.kv.add_scores
        eng.kv.add_scores = lambda req, scores: (seen.append((req.request_id, req.num_computed_tokens, scores)),
                                                 add(req, scores))
        outs, _ = run_steps(llm, prompts, [greedy(50, kv_compression=comps[0]), greedy(50),
                                           greedy(50, kv_compression=comps[1]), greedy(50)])
        runs.append(([o.outputs[0].token_ids for o in outs], seen))
    assert runs[0][0] == runs[1][0]
    assert [s[:2] for s in runs[0][1]] == [s[:2] for s in runs[1][1]] and len(runs[0][1]) > 50
    for (_, _, a), (_, _, b) in zip(runs[0][1], runs[1][1]):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5)


def test_decode_graphs_never_replay_released_or_scored_entries():
    """A CUDA graph captures positions = start_pos and tables from block 0: a decode whose
    table misses released blocks, or whose rows are scored (h2o), runs eagerly (tests/test_cuda.py
    runs it on a GPU)."""
    from types import SimpleNamespace

    from kvserve.core.step import ScheduledRequest, SchedulerOutput
    from kvserve.runner.model_runner import ModelRunner
    runner = SimpleNamespace(graphs=SimpleNamespace(size_for=lambda n: n))

    def step(comp=None, released=0):
        req = Request("r", list(range(100)), greedy(4, kv_compression=comp))
        return SchedulerOutput([ScheduledRequest(req, 100, 1, list(range(7)), True, num_released_tokens=released)])
    assert ModelRunner._replays(runner, step())
    assert ModelRunner._replays(runner, step({"method": "streaming", "window": 32}))  # nothing released yet
    assert not ModelRunner._replays(runner, step({"method": "streaming", "window": 32}, released=32))
    assert not ModelRunner._replays(runner, step({"method": "h2o", "heavy_tokens": 32, "window": 32}))
    # snapkv scores only the prompt's last chunk: its decodes replay until blocks are released
    assert ModelRunner._replays(runner, step({"method": "snapkv", "heavy_tokens": 32, "window": 32}))


@pytest.mark.needs("avx512_bf16")
def test_sliding_window_release_changes_nothing_in_bf16_kernels(tmp_path):
    """The bf16 path (pairs layout, varlen kernel, compiled layer loop) reads a released
    sequence's shorter table at an offset: the same tokens as with every block kept. Blocks of
    32 keep the kernel's 32-key chunks on the same keys; with 16, an odd number of released
    blocks regroups them, which changes float sums, not the keys seen (bench/NOTES.md,
    "Released blocks leave the block table; the new tokens keep their rotary positions")."""
    path = str(make_tiny_model(tmp_path, kind="mistral_swa32"))
    prompts = rand_prompts(16, [10, 70, 130], 49152)
    runs = []
    bs = 32
    for release in (True, False):
        llm = LLM(path, dtype="bfloat16", block_size=bs, max_num_batched_tokens=32, kv_cache_memory=16 * 2**20,
                  enable_prefix_caching=False)
        if not release:
            llm.engine.kv.sliding_window = None  # keep every block: the kernels mask the window
        outs, peak = run_steps(llm, prompts, greedy(80))
        runs.append(([o.outputs[0].token_ids for o in outs], peak, dict(llm.engine.kv.num_released)))
    assert runs[0][0] == runs[1][0]
    assert runs[0][1] <= 32 // bs + 1 + 32 // bs < runs[1][1]
    assert runs[0][2]["sliding_window"] > 0 and not runs[1][2]


# -- invariants under random traffic (no torch: the cost-model runner) ----------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvserve.config import SchedulerConfig  # noqa: E402
from kvserve.core.request import RequestStatus  # noqa: E402
from kvserve.sched.scheduler import Scheduler  # noqa: E402
from kvserve.tools.cost_model import CostModelRunner  # noqa: E402

COMPRESSIONS = [None, {"method": "streaming", "sink_tokens": 2, "window": 6},
                {"method": "h2o", "heavy_tokens": 4, "window": 4},
                {"method": "snapkv", "sink_tokens": 2, "heavy_tokens": 4, "window": 4, "observation_tokens": 2}]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(0, 3), min_size=1, max_size=30), st.integers(1, 30),
              st.integers(0, 3)),
    st.tuples(st.just("step")), st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("preempt"), st.integers(0, 50))), min_size=1, max_size=60),
    num_blocks=st.integers(14, 30), block_size=st.sampled_from([1, 2, 4]), caching=st.booleans(),
    window=st.sampled_from([None, 3, 8]), chunk=st.integers(1, 24))
def test_releases_keep_the_pool_consistent(ops, num_blocks, block_size, caching, window, chunk):
    """Random adds, steps, aborts and preemptions with sliding-window releases or a mix of
    compressed and plain requests: the pool stays consistent every step and drains to empty."""
    max_len = min(60, num_blocks * block_size)
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching, sliding_window=window)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=chunk, max_model_len=max_len), kv)
    runner = CostModelRunner(vocab_size=4)
    live, n = [], 0

    def step():
        out = sched.schedule()
        for e in out.scheduled:
            assert len(e.block_table) * block_size >= e.start_pos - e.num_released_tokens + e.num_new_tokens
        sched.update_from_output(out, runner.execute(out))

    for op in ops:
        if op[0] == "add":
            _, prompt, max_tokens, which = op
            prompt = prompt[:max_len - 1]
            comp = None if window else COMPRESSIONS[which]
            rid = str(n)
            n += 1
            sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=min(max_tokens, max_len - len(prompt)),
                                                                  ignore_eos=True, kv_compression=comp)))
            live.append(rid)
        elif op[0] == "step":
            step()
        elif op[0] == "abort" and live:
            sched.finish_request(live[op[1] % len(live)], RequestStatus.FINISHED_ABORTED)
        elif op[0] == "preempt" and live:
            sched.preempt_request(live[op[1] % len(live)])
        kv.check_integrity()
        live = [r for r in live if r in sched.requests]
    for _ in range(3000):
        if not sched.has_unfinished_requests():
            break
        step()
        kv.check_integrity()
    assert not sched.has_unfinished_requests()
    assert kv.pool.num_used_blocks == 0


def test_swap_preemption_beside_released_blocks(tiny):
    """A sequence missing released blocks resumes by recompute; its plain neighbour swaps and
    resumes exactly; nothing leaks."""
    llm = LLM(tiny, dtype="float32", block_size=BS, max_num_batched_tokens=64, kv_cache_memory=8 * 2**20,
              max_model_len=256, swap_space=0.02)
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    prompts = rand_prompts(17, [40, 40], vocab)
    (alone,), _ = run_steps(llm, prompts[1:], greedy(60))
    eng.add_request("c", prompts[0], greedy(60, kv_compression={"method": "streaming", "sink_tokens": 4,
                                                                "window": 16}))
    eng.add_request("p", prompts[1], greedy(60))
    outs = {}
    for i in range(400):
        if not eng.has_unfinished_requests():
            break
        if i == 30:
            assert eng.kv.released_tokens(eng.scheduler.requests["c"]) > 0
            assert eng.scheduler.preempt_request("c") and eng.scheduler.preempt_request("p")
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        eng.kv.check_integrity()
    assert eng.scheduler.num_swaps == 1 and eng.scheduler.num_preemptions == 2
    assert outs["p"].outputs[0].token_ids == alone.outputs[0].token_ids
    assert len(outs["c"].outputs[0].token_ids) == 60
    assert eng.kv.pool.num_used_blocks == 0

"""Cache-write accounting: the prompt tokens a request wrote to the prefix cache (its full prompt
blocks the cache did not hold before), beside the tokens it read (`cached_tokens`). Offline in
RequestOutput.num_cache_write_tokens; through the server in
usage.prompt_tokens_details.cache_write_tokens, streaming and not, completions and chat."""
from __future__ import annotations

import json
import random
import uuid

import httpx
import pytest
from helpers import greedy
from kv_cases import BS, SMALL
from server_util import MAIN_ARGS, shared_server

from kvserve import LLM
from kvserve.config import SchedulerConfig
from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.tiers import EngineFingerprint, HostTier
from kvserve.kv.tiers.base import frame_size
from kvserve.kv.tiers.chain import TierChain
from kvserve.kv.tiers.order import Retention
from kvserve.sched.scheduler import Scheduler
from kvserve.tools.cost_model import CostModelRunner


def full(n: int, bs: int = BS) -> int:
    return n // bs * bs


def test_offline_first_writes_second_reads_extension_writes_only_its_blocks(tiny):
    rng = random.Random(0)
    prompt = [rng.randrange(1, 200) for _ in range(100)]  # 6 full blocks of 16 and 4 tokens
    llm = LLM(tiny, **SMALL)
    try:
        first = llm.generate([prompt], greedy(3), use_tqdm=False)[0]
        assert first.num_cached_tokens == 0 and first.num_cache_write_tokens == full(100) == 96
        second = llm.generate([prompt], greedy(3), use_tqdm=False)[0]
        assert second.num_cache_write_tokens == 0
        assert second.num_cached_tokens >= 96  # the full blocks, and the partial one's tokens too
        longer = prompt + [rng.randrange(1, 200) for _ in range(60)]  # 160 tokens: 10 full blocks
        third = llm.generate([longer], greedy(3), use_tqdm=False)[0]
        # Blocks 0-5 were cached; block 6 (its first 4 tokens cached as a partial block) and 7-9 are new.
        assert third.num_cached_tokens >= 96
        assert third.num_cache_write_tokens == 160 - 96
        # n > 1: the sequences share the prompt, which is written once.
        fresh = [rng.randrange(1, 200) for _ in range(40)]
        many = llm.generate([fresh], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, n=3),
                            use_tqdm=False)[0]
        assert len(many.outputs) == 3 and many.num_cache_write_tokens == full(40)
    finally:
        llm.engine.close()


def test_caching_off_writes_nothing(tiny):
    llm = LLM(tiny, **SMALL, enable_prefix_caching=False)
    try:
        out = llm.generate([list(range(1, 70))], greedy(2), use_tqdm=False)[0]
        assert out.num_cache_write_tokens == 0
    finally:
        llm.engine.close()


def test_blocks_restored_from_a_tier_are_reads_not_writes():
    """Torch-free: a prompt evicted to the host tier and restored from it writes nothing again."""
    fp = EngineFingerprint(model="m", kv_cache_dtype="bfloat16", block_size=4, num_layers=1, num_kv_heads=1,
                           head_dim=8)
    chain = TierChain(HostTier(fp, 64 * frame_size(b"k" * 32, 64)))
    chain.decode = lambda p: (tuple(bytes(p).rstrip(b"\xff")), p)
    kv = KVCacheManager(12, 4, enable_caching=True, tiers=chain)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=48), kv)
    runner = CostModelRunner(vocab_size=4)

    def run(reqs):
        for r in reqs:
            sched.add_request(r)
        while sched.has_unfinished_requests():
            out = sched.schedule()
            for o in out.kv_offloads:
                chain.host.put(o.key, bytes(o.token_ids).ljust(64, b"\xff"), o.token_ids, Retention(o.priority))
            sched.update_from_output(out, runner.execute(out))

    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    first = Request("a", [1, 2, 3, 0] * 3 + [1], sp)
    run([first])
    assert first.num_cache_write_tokens == 12
    run([Request(f"f{i}", [4 + i] * 45, sp) for i in range(3)])  # pushes it off the device
    again = Request("b", [1, 2, 3, 0] * 3 + [2], sp)
    run([again])
    assert again.num_cached_tokens == 12 and again.num_cache_write_tokens == 0
    assert sum(chain.stats.restored_blocks.values()) == 3


# -- through the server -------------------------------------------------------------------------
MODEL = "SmolLM2-135M-Instruct"
SERVER_BS = 16  # the server's default --block-size


@pytest.fixture(scope="session")
def server(request):
    return shared_server(request, *MAIN_ARGS)


def _sse_usage(r: httpx.Response) -> dict:
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return events[-1]["usage"]


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_server_usage_reports_cache_writes(server, endpoint, stream):
    text = f"[{uuid.uuid4()}] " + "Gears, brakes, tyres, chains and saddles, briefly. " * 8
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0}
    body.update({"prompt": text} if endpoint == "completions" else {"messages": [{"role": "user", "content": text}]})
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    usages = []
    for _ in range(2):
        r = httpx.post(f"{server.url}/v1/{endpoint}", json=body, timeout=120)
        assert r.status_code == 200, r.text
        usages.append(_sse_usage(r) if stream else r.json()["usage"])
    first, second = (u["prompt_tokens_details"] for u in usages)
    n = usages[0]["prompt_tokens"]
    assert n > 64
    # The fresh uuid leaves nothing to hit but the chat template's header (its default system
    # prompt): the blocks after the full ones read are written, a partly read one included.
    assert first["cached_tokens"] < 3 * SERVER_BS
    assert first["cache_write_tokens"] == full(n, SERVER_BS) - full(first["cached_tokens"], SERVER_BS) > 0
    assert second["cache_write_tokens"] == 0 and second["cached_tokens"] >= full(n, SERVER_BS)

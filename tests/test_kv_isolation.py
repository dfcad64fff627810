"""What must never cross between prefixes: another tenant's blocks (salted hashes) in the device
pool, in every offload tier and across a restart; and a block whose hash collides with another's
(the token check, on the device pool and on every tier's restore)."""
from __future__ import annotations

import random

import pytest
from helpers import greedy

from kvserve import LLM
from kvserve.kv import manager

BS = 16
POOL = 24  # device blocks
PROMPT_LEN = 4 * BS + 5
SMALL = dict(dtype="float32", block_size=BS, num_gpu_blocks_override=POOL, max_model_len=POOL * BS,
             max_num_batched_tokens=256, check_integrity=True)


def _prompts(seed: int, n: int, length: int = PROMPT_LEN) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(length)] for _ in range(n)]


PROMPT = _prompts(1, 1)[0]
OTHER = _prompts(2, 1)[0]  # the same length, other tokens: under a forced collision, the same hashes
FILLERS = _prompts(3, 5, 6 * BS)  # 35 blocks through a pool of 24: all earlier blocks leave


TIERS = ("host", "disk", "redis")


def tier_args(tier: str, tmp_path, request) -> dict:
    """The engine flags of one tier (a real redis-server for Redis, stopped after the test)."""
    if tier == "host":
        return dict(swap_space=0.01)
    if tier == "disk":
        return dict(kv_disk_path=str(tmp_path / "kv"))
    return dict(kv_redis_url=request.getfixturevalue("redis_server").url)


def run(llm, prompt, salt=None):
    out = llm.generate([{"prompt_token_ids": prompt, **({"cache_salt": salt} if salt else {})}], greedy(4),
                       use_tqdm=False)[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def evict_device(llm):
    """Fill the pool with other prompts so that every earlier block leaves the device."""
    for f in FILLERS:
        run(llm, f)


def tier_hits(llm, tier: str) -> int:
    return llm.engine.get_stats().tier_hits.get(tier, 0)


@pytest.fixture(scope="module")
def expected(tiny):
    """Each prompt's output with nothing cached at all."""
    llm = LLM(tiny, **SMALL, enable_prefix_caching=False)
    return {tuple(p): run(llm, p)[0] for p in (PROMPT, OTHER)}


# -- tenants ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_tenants_do_not_share_the_device_pool(tiny, expected):
    llm = LLM(tiny, **SMALL)
    assert run(llm, PROMPT, "tenant-a") == (expected[tuple(PROMPT)], 0)
    assert run(llm, PROMPT, "tenant-b") == (expected[tuple(PROMPT)], 0)  # b never hits a's blocks
    assert run(llm, PROMPT, "tenant-a")[1] == PROMPT_LEN - 1  # a does hit its own (all but the last token)


@pytest.mark.slow
@pytest.mark.parametrize("tier", TIERS)
def test_tenants_do_not_share_a_tier(tiny, expected, tmp_path, tier, request):
    llm = LLM(tiny, **SMALL, **tier_args(tier, tmp_path, request))
    try:
        assert run(llm, PROMPT, "tenant-a") == (expected[tuple(PROMPT)], 0)
        evict_device(llm)
        before = tier_hits(llm, tier)
        assert run(llm, PROMPT, "tenant-b") == (expected[tuple(PROMPT)], 0)  # a's blocks sit in the tier
        assert tier_hits(llm, tier) == before
        evict_device(llm)
        tokens, cached = run(llm, PROMPT, "tenant-a")
        assert tokens == expected[tuple(PROMPT)] and cached == 4 * BS  # ... and a finds them there
        assert tier_hits(llm, tier) > before
    finally:
        llm.engine.close()


def test_tenants_do_not_share_the_disk_tier_across_a_restart(tiny, expected, tmp_path):
    disk = dict(kv_disk_path=str(tmp_path / "kv"))
    first = LLM(tiny, **SMALL, **disk)
    run(first, PROMPT, "tenant-a")
    first.engine.close()  # writes the pool's blocks down
    second = LLM(tiny, **SMALL, **disk)
    try:
        assert run(second, PROMPT, "tenant-b") == (expected[tuple(PROMPT)], 0)
        assert run(second, PROMPT) == (expected[tuple(PROMPT)], 0)  # no salt is a tenant of its own
        assert run(second, PROMPT, "tenant-a") == (expected[tuple(PROMPT)], 4 * BS)
    finally:
        second.engine.close()


# -- hash collisions ------------------------------------------------------------------------------

@pytest.fixture
def colliding(monkeypatch):
    """OTHER's block hashes made PROMPT's (computed over PROMPT's tokens where OTHER's stand), a
    collision SHA-256 makes impossible to find by chance; every other sequence hashes as it does."""
    real = manager.extend_block_hashes

    def collide(hashes, root, tokens, block_size, *args):
        if list(tokens[:PROMPT_LEN]) == OTHER[:len(tokens)]:
            tokens = PROMPT[:len(tokens)] + list(tokens[PROMPT_LEN:])
        return real(hashes, root, tokens, block_size, *args)

    monkeypatch.setattr(manager, "extend_block_hashes", collide)


def test_a_colliding_hash_never_serves_the_device_pool_block(tiny, expected, colliding):
    llm = LLM(tiny, **SMALL)
    assert run(llm, PROMPT) == (expected[tuple(PROMPT)], 0)
    assert run(llm, OTHER) == (expected[tuple(OTHER)], 0)  # found PROMPT's blocks by hash, refused them


@pytest.mark.slow
@pytest.mark.parametrize("tier", TIERS)
def test_a_colliding_hash_never_restores_a_tier_entry(tiny, expected, tmp_path, tier, request, colliding):
    llm = LLM(tiny, **SMALL, **tier_args(tier, tmp_path, request))
    try:
        run(llm, PROMPT)
        evict_device(llm)  # PROMPT's blocks now in the tier, under hashes OTHER's blocks share
        before = tier_hits(llm, tier)
        assert run(llm, OTHER) == (expected[tuple(OTHER)], 0)
        assert tier_hits(llm, tier) == before
        assert llm.engine.get_stats().tier_token_mismatches.get(tier, 0) >= 1  # found, checked, refused
    finally:
        llm.engine.close()

"""`kvserve analyze` on generated logs whose percentiles and prefix reuse are known by construction."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from kvserve.core.request_log import format_request_log_record
from kvserve.tools import analyze as analyze_tool
from kvserve.tools.analyze import percentile, read_request_log, recommend_max_model_len, simulate_prefix_cache
from kvserve.tools.plan import plan_kv
from kvserve.tools.presets import PRESETS


def _write_jsonl(path, records, extra_lines=()):
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return str(path)


def _run_json(capsys, *argv) -> tuple[int, dict]:
    rc = analyze_tool.main([*argv, "--json"])
    captured = capsys.readouterr()
    return rc, (json.loads(captured.out) if rc == 0 else {"stderr": captured.err})


@pytest.fixture
def known_log(tmp_path):
    """1,000 requests, prompt i and output 2i for i = 1..1000, in shuffled order: total = 3i, so the
    nearest-rank P99 total is 3 x 990 = 2,970 and P50 is 3 x 500 = 1,500."""
    order = list(range(1, 1001))
    random.Random(7).shuffle(order)
    records = [{"prompt_tokens": i, "output_tokens": 2 * i} if i % 2 else
               {"usage": {"prompt_tokens": i, "completion_tokens": 2 * i}} for i in order]
    return _write_jsonl(tmp_path / "log.jsonl", records)


def test_known_percentiles_and_recommendation(capsys, known_log):
    rc, d = _run_json(capsys, known_log, "--no-plan")
    assert rc == 0 and d["num_requests"] == 1000
    assert (d["total"]["p50"], d["total"]["p95"], d["total"]["p99"], d["total"]["max"]) == (1500, 2850, 2970, 3000)
    assert (d["prompt"]["p99"], d["output"]["p99"]) == (990, 1980)
    # 2,970 x 1.2 = 3,564 -> rounded up to 16 = 3,568.
    assert d["recommended_max_model_len"] == 3568
    rc, d = _run_json(capsys, known_log, "--no-plan", "--block-size", "128")
    assert d["recommended_max_model_len"] == 3584  # 28 blocks of 128


def test_percentile_is_nearest_rank_like_numpy_inverted_cdf():
    rng = np.random.default_rng(3)
    for n in (1, 2, 7, 100, 1001):
        values = sorted(int(v) for v in rng.integers(1, 10_000, n))
        for q in (50, 95, 99, 100):
            assert percentile(values, q) == int(np.percentile(values, q, method="inverted_cdf"))


def test_recommendation_rounding_is_exact():
    assert recommend_max_model_len(1000, 16) == 1200  # 1000 x 1.2 is exactly 1200, not 1200.0000001
    assert recommend_max_model_len(1001, 16) == 1216
    assert recommend_max_model_len(1, 16) == 16
    assert recommend_max_model_len(1000, 16, headroom=0.0) == 1008


def test_prefix_cache_simulation_by_hand():
    bs = 16
    shared = list(range(1000, 1064))                      # 64 tokens = 4 full blocks
    a = shared + list(range(1, 11))                       # 74 tokens: first seen, no hit
    b = shared + list(range(100, 120))                    # 84: hits the 4 shared blocks = 64
    c = list(shared)                                      # exactly 64: the last token is recomputed,
                                                          # so only 3 blocks (48 tokens) may hit
    d = list(range(5000, 5050))                           # unrelated: 0
    e = shared[:32] + list(range(7000, 7040))             # branches after 2 blocks: 32
    reuse = simulate_prefix_cache([a, b, c, d, e], bs)
    assert reuse.hit_tokens == 64 + 48 + 32
    assert reuse.prompt_tokens == 74 + 84 + 64 + 50 + 72
    assert reuse.requests_with_hits == 3
    assert reuse.ratio == pytest.approx(144 / 344)
    # A middle block equal to a cached block under another parent is not a hit (chain semantics).
    f = list(range(9000, 9016)) + shared[16:32] + [1]
    assert simulate_prefix_cache([a, f], bs).hit_tokens == 0


def test_shared_prefix_ratio_on_a_generated_log(capsys, tmp_path):
    rng = random.Random(0)
    system = list(range(20_000, 20_100))  # 100 tokens: 6 full blocks of 16 are shareable
    records = [{"prompt_tokens": system + [rng.randrange(50_000) for _ in range(rng.randrange(5, 300))],
                "completion_tokens": rng.randrange(1, 100)} for _ in range(200)]
    rc, d = _run_json(capsys, _write_jsonl(tmp_path / "s.jsonl", records), "--no-plan")
    prompt_tokens = sum(len(r["prompt_tokens"]) for r in records)
    assert d["prefix_reuse"]["hit_tokens"] == 199 * 96
    assert d["shared_prefix_ratio"] == pytest.approx(199 * 96 / prompt_tokens)


def test_kvserve_request_log_round_trip(capsys, tmp_path):
    lines = []
    prefix = list(range(32))
    for i in range(10):
        ids = prefix + [100 + i] * 8
        lines.append(format_request_log_record(
            request_id=f"cmpl-{i}", prompt_tokens=len(ids), output_tokens=5 + i, cached_tokens=32 if i else 0,
            ttft=0.01 * (i + 1), e2e=0.5, finish_reason="length", prompt_token_ids=ids, time=1_700_000_000 + i))
    path = tmp_path / "req.log"
    path.write_text("\n".join(lines) + "\n")
    first = json.loads(lines[0])
    assert list(first) == ["time", "request_id", "prompt_tokens", "output_tokens", "cached_tokens",
                           "prompt_token_ids", "ttft", "e2e", "finish_reason"]
    log = read_request_log(str(path))
    assert [r.prompt_len for r in log.records] == [40] * 10 and log.records[3].output_len == 8
    rc, d = _run_json(capsys, str(path), "--no-plan")
    assert d["observed_cached_ratio"] == pytest.approx(9 * 32 / 400)
    assert d["prefix_reuse"]["hit_tokens"] == 9 * 32  # the simulation agrees with what the server saw


@pytest.mark.parametrize("kwargs, message", [
    (dict(cached_tokens=50), "exceeds prompt_tokens"),
    (dict(output_tokens=-1), "output_tokens must be"),
    (dict(prompt_token_ids=[1, 2]), "prompt_token_ids for prompt_tokens=40"),
])
def test_request_log_record_validation(kwargs, message):
    base = dict(request_id="r", prompt_tokens=40, output_tokens=3, cached_tokens=0, ttft=None, e2e=1.0,
                finish_reason="abort")
    with pytest.raises(ValueError, match=message):
        format_request_log_record(**{**base, **kwargs})


def test_concurrency_gain_uses_the_planner(capsys, known_log):
    rc, d = _run_json(capsys, known_log, "--model", "SmolLM2-135M", "--kv-cache-memory", "2GiB")
    assert rc == 0
    c = d["concurrency"]
    smol = PRESETS["SmolLM2-135M"][0]
    rec = plan_kv(smol, 2 * 1024**3, 16, "auto", "bfloat16", 3568, mean_context_len=1502)
    base = plan_kv(smol, 2 * 1024**3, 16, "auto", "bfloat16", 8192)
    assert c["recommended"]["max_concurrency"] == pytest.approx(rec.max_concurrency)
    assert c["recommended"]["max_concurrency_at_mean"] == pytest.approx(rec.max_concurrency_at_mean)
    assert c["baseline"]["max_model_len"] == 8192
    assert c["gain"] == pytest.approx(rec.max_concurrency / base.max_concurrency)
    # Comparing with an explicit current setting, and a recommendation past the model's context.
    rc, d = _run_json(capsys, known_log, "--model", "SmolLM2-135M", "--kv-cache-memory", "2GiB",
                      "--max-model-len", "4096", "--headroom", "2.0")
    assert d["concurrency"]["baseline"]["max_model_len"] == 4096
    assert d["recommended_max_model_len"] == 8912 and any("max_position_embeddings" in w for w in d["warnings"])


def test_text_report(capsys, known_log):
    assert analyze_tool.main([known_log, "--model", "Llama-3.1-8B", "--gpu-memory", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "Recommended --max-model-len 3,568" in out and "P99 total 2,970" in out
    assert "Shared-prefix ratio: n/a" in out and "Concurrency on Llama-3.1-8B" in out


def test_torn_and_foreign_lines_are_skipped_with_a_warning(capsys, tmp_path):
    path = _write_jsonl(tmp_path / "t.jsonl", [{"prompt_tokens": 10, "output_tokens": 1}] * 3,
                        extra_lines=['{"event": "startup"}', '{"prompt_tokens": 12, "outp'])
    rc, d = _run_json(capsys, path, "--no-plan")
    assert rc == 0 and d["num_requests"] == 3 and d["skipped_lines"] == 2
    assert "line 4: no prompt_tokens field" in d["warnings"][0]


@pytest.mark.parametrize("content, message", [
    (None, "cannot open"),
    ('{"foo": 1}\n', "no usable request records"),
    ('{"prompt_tokens": "many"}\n', "no usable request records"),
    (b"\xff\xfe\x00 not text", "is not UTF-8 text"),
])
def test_user_errors(capsys, tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    rc, d = _run_json(capsys, str(path), "--no-plan")
    assert rc == 2 and message in d["stderr"]

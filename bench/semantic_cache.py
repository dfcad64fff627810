"""The semantic cache's threshold and cost: hit rate (paraphrases found) and false-hit rate
(hard negatives served) per similarity threshold on bench/data/paraphrase_pairs.jsonl, the
embedder's time per question, and a lookup's time in a filled store. Prints a table, writes JSON.

    python bench/semantic_cache.py [--out bench/results/semantic_cache.json] [--entries 10000]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from kvserve.semantic_cache import CacheKey, SemanticCache
from kvserve.semantic_cache.embedder import MiniLMEmbedder

DATA = Path(__file__).parent / "data" / "paraphrase_pairs.jsonl"
THRESHOLDS = [0.7, 0.75, 0.8, 0.85, 0.875, 0.9, 0.925, 0.95]


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/semantic_cache.json")
    ap.add_argument("--entries", type=int, default=10_000, help="entries in the store the lookup runs against")
    a = ap.parse_args()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    pairs = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    embed = MiniLMEmbedder()
    sims = [float(embed([p["a"]])[0] @ embed([p["b"]])[0]) for p in pairs]
    pos = [s for s, p in zip(sims, pairs) if p["paraphrase"]]
    neg = [s for s, p in zip(sims, pairs) if not p["paraphrase"]]
    curve = [{"threshold": t, "hit_rate": sum(s >= t for s in pos) / len(pos),
              "false_hit_rate": sum(s >= t for s in neg) / len(neg)} for t in THRESHOLDS]
    print(f"{len(pos)} paraphrase pairs, {len(neg)} hard negatives")
    print(f"{'threshold':>9} {'hit rate':>9} {'false hits':>10}")
    for c in curve:
        print(f"{c['threshold']:>9} {c['hit_rate']:>9.1%} {c['false_hit_rate']:>10.1%}")
    embed_ms = timed(lambda: embed(["How do I reset my password on the website?"]), 30)
    cache = SemanticCache(None, embed.dim)
    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((a.entries, embed.dim)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    keys = [CacheKey("m", f"tenant-{i % 100}", [], {"temperature": 0}) for i in range(100)]
    for i, v in enumerate(vecs):
        cache.insert(keys[i % 100], None, f"q{i}", v, {"content": "a"})
    lookup_ms = timed(lambda: cache.lookup(keys[7], vecs[7]), 200)
    print(f"embed one question: {embed_ms:.1f} ms (median of 30); lookup among {a.entries} entries "
          f"(100 keys): {lookup_ms:.2f} ms (median of 200)")
    Path(a.out).write_text(json.dumps({"pairs": len(pairs), "similarities": {"paraphrase": pos, "negative": neg},
                                       "curve": curve, "embed_ms": embed_ms, "lookup_ms": lookup_ms,
                                       "entries": a.entries}, indent=1))


if __name__ == "__main__":
    main()

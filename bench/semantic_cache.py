"""The semantic cache's threshold and cost: hit rate (paraphrases found) and false-hit rate
(hard negatives served) per similarity threshold on bench/data/paraphrase_pairs.jsonl, the
embedder's time per question, and a lookup's time in a filled store. With --serve: a server with
--semantic-cache asked each pair's first question (a miss: generated) then its second (a hit when
similar enough), end-to-end latency of each. Prints a table, writes JSON.

    python bench/semantic_cache.py [--out bench/results/semantic_cache.json] [--entries 10000] [--serve]
                                   [--redis redis://127.0.0.1:6379/0] [--plot docs/semantic-cache-threshold.png]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
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


def serve(pairs: list[dict], max_tokens: int) -> dict:
    """Latency of misses (generated) and of the paraphrases that follow them, through the server."""
    import httpx
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    src = str(Path(__file__).resolve().parents[1] / "src")
    store = tempfile.mkdtemp(prefix="kvserve-semantic-")
    log = open(os.path.join(store, "server.log"), "w")
    proc = subprocess.Popen([sys.executable, "-m", "kvserve", "serve", "--port", str(port), "--max-model-len", "512",
                             "--disable-log-stats", "--semantic-cache", os.path.join(store, "cache.db")],
                            env=dict(os.environ, PYTHONPATH=src), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            raise SystemExit(f"server not healthy in 300 s; see {log.name}")

        def ask(q: str) -> tuple[float, str]:
            t = time.perf_counter()
            r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": q}], "temperature": 0, "max_tokens": max_tokens})
            r.raise_for_status()
            return time.perf_counter() - t, r.headers.get("x-kvserve-semantic-cache", "")
        rows = []
        for p in pairs:
            miss_s, miss_h = ask(p["a"])
            then_s, then_h = ask(p["b"])
            rows.append({"paraphrase": p["paraphrase"], "miss_s": miss_s, "then_s": then_s,
                         "then_hit": then_h.startswith("hit"), "first": miss_h})
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    hits = [r for r in rows if r["then_hit"]]
    out = {"max_tokens": max_tokens, "requests": 2 * len(rows),
           # the hard negatives reuse the paraphrases' first questions: those are hits, not generated
           "generated_ms_p50": 1000 * statistics.median(r["miss_s"] for r in rows if r["first"] == "miss"),
           "hit_ms_p50": 1000 * statistics.median(r["then_s"] for r in hits) if hits else None,
           "paraphrase_hit_rate": sum(r["then_hit"] for r in rows if r["paraphrase"]) / max(1, sum(r["paraphrase"] for r in rows)),
           "negative_false_hits": sum(r["then_hit"] for r in rows if not r["paraphrase"]), "rows": rows}
    print(f"server: generated answer p50 {out['generated_ms_p50']:.0f} ms ({max_tokens} tokens max), hit p50 "
          f"{out['hit_ms_p50'] or float('nan'):.0f} ms; paraphrase hit rate {out['paraphrase_hit_rate']:.1%}, "
          f"false hits {out['negative_false_hits']} of {sum(not r['paraphrase'] for r in rows)}")
    return out


def lookup_cost(location: str | None, dim: int, entries: int, keys: int) -> float:
    """Median ms of one lookup (a hit) among `entries` random entries spread over `keys` keys."""
    cache = SemanticCache(location, dim, max_entries=entries + 1)
    if location:  # Redis: start from an empty database
        cache.store._client.flushdb()
    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((entries, dim)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    ks = [CacheKey("m", f"tenant-{i % keys}", [], {"temperature": 0}) for i in range(keys)]
    for i, v in enumerate(vecs):
        cache.insert(ks[i % keys], None, f"q{i}", v, {"content": "a"})
    cache.lookup(ks[7 % keys], vecs[7])  # a server's first lookup of a key fetches its embeddings
    ms = timed(lambda: cache.lookup(ks[7 % keys], vecs[7]), 200)
    print(f"{location or 'sqlite (memory)'}: lookup among {entries} entries in {keys} keys: {ms:.2f} ms (median of 200)")
    cache.close()
    return ms


def plot_curve(pos: list[float], neg: list[float], path: str, default: float = 0.9) -> None:
    """Hit rate and false-hit rate at every threshold from 0.5 to 1: the curve the default is read from."""
    from kvserve.tools.plotting import pyplot
    plt = pyplot()
    ts = np.linspace(0.5, 1.0, 201)
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=110)
    ax.plot(ts, [100 * np.mean([s >= t for s in pos]) for t in ts], label=f"hit rate ({len(pos)} paraphrase pairs)")
    ax.plot(ts, [100 * np.mean([s >= t for s in neg]) for t in ts],
            label=f"false-hit rate ({len(neg)} hard negatives)")
    ax.axvline(default, color="grey", linestyle="--", linewidth=1)
    ax.text(default + 0.004, 50, f"default {default}", color="grey", fontsize=8)
    ax.set_xlabel("--semantic-cache-threshold (cosine similarity, all-MiniLM-L6-v2)")
    ax.set_ylabel("% of pairs served from the cache")
    ax.set_xlim(0.5, 1.0)
    ax.set_ylim(0, 101)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/semantic_cache.json")
    ap.add_argument("--entries", type=int, default=10_000, help="entries in the store the lookup runs against")
    ap.add_argument("--serve", action="store_true", help="also measure hit vs generated latency through a server")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--redis", metavar="URL", help="also time lookups in the Redis store at URL (flushes its db)")
    ap.add_argument("--plot", metavar="PNG", help="draw hit and false-hit rate against the threshold into PNG")
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
    if a.plot:
        plot_curve(pos, neg, a.plot)
        print(f"wrote {a.plot}")
    embed_ms = timed(lambda: embed(["How do I reset my password on the website?"]), 30)
    print(f"embed one question: {embed_ms:.1f} ms (median of 30)")
    lookups = {"sqlite": {n: lookup_cost(None, embed.dim, a.entries, n) for n in (100, 1)}}
    if a.redis:
        lookups["redis"] = {n: lookup_cost(a.redis, embed.dim, a.entries, n) for n in (100, 1)}
    result = {"pairs": len(pairs), "similarities": {"paraphrase": pos, "negative": neg}, "curve": curve,
              "embed_ms": embed_ms, "lookup_ms": lookups["sqlite"][100], "lookups_ms": lookups, "entries": a.entries}
    if a.serve:
        result["serve"] = serve(pairs, a.max_tokens)
    Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

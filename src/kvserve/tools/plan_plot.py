"""`kvserve plan --plot`: max concurrency against --max-model-len, one line per KV cache dtype."""
from __future__ import annotations

from kvserve.tools.plan import PlanReport, fmt_bytes
from kvserve.tools.plotting import pyplot

_BOX = {"facecolor": "white", "alpha": 0.8, "edgecolor": "none", "pad": 1}


def plot_plan(report: PlanReport, path: str, max_num_seqs: int | None = None) -> list[tuple[str, list, list]]:
    """Draw report.curves (computed by plan_kv, like the printed table) into a PNG; returns what
    was drawn, (kv dtype, lengths, concurrency) per line, read back from the figure."""
    plt = pyplot()
    p = report.plan
    fig, ax = plt.subplots(figsize=(8, 5))
    for row in report.curves:
        xs = [c["max_model_len"] for c in row.max_concurrency]
        ys = [c["max_concurrency"] for c in row.max_concurrency]
        name = row.kv_cache_dtype if row.kv_cache_dtype != "auto" else f"auto ({p.model_dtype})"
        ax.plot(xs, ys, marker="o", markersize=3, gid=row.kv_cache_dtype,
                label=f"{name}: {row.bytes_per_token:,.0f} B/token, {row.num_tokens:,} tokens")
    # Labels sit in axes coordinates along one axis and data coordinates along the other.
    ax.axvline(p.max_model_len, color="gray", linestyle="--", linewidth=1)
    ax.text(p.max_model_len * 0.96, 0.02, f" --max-model-len {p.max_model_len:,}", transform=ax.get_xaxis_transform(),
            fontsize=8, color="gray", rotation=90, va="bottom", ha="right", bbox=_BOX)
    ax.axhline(1, color="firebrick", linewidth=1, alpha=0.6)
    ax.text(0.01, 1, "below 1: one request of that length does not fit", transform=ax.get_yaxis_transform(),
            fontsize=8, color="firebrick", va="top", bbox=_BOX)
    if max_num_seqs:
        ax.axhline(max_num_seqs, color="darkorange", linewidth=1, alpha=0.6)
        ax.text(0.01, max_num_seqs, f"--max-num-seqs {max_num_seqs}: above it the scheduler is the limit, not KV",
                transform=ax.get_yaxis_transform(), fontsize=8, color="darkorange", va="bottom", bbox=_BOX)
    ax.set(xscale="log", yscale="log", xlabel="--max-model-len (tokens)",
           ylabel="max concurrent requests of that length",
           title=f"{report.model}: KV budget {fmt_bytes(report.budget.kv_cache_memory)} per GPU, "
                 f"block size {p.block_size}, TP {p.tensor_parallel_size}")
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}"))
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(title="--kv-cache-dtype", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    drawn = [(line.get_gid(), list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()
             if line.get_gid()]
    plt.close(fig)
    return drawn

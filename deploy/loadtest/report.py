"""The figures of a run: distributions, goodput, the summary block, the sweep table, plots."""

from __future__ import annotations

import json
import math
from pathlib import Path

from deploy.loadtest.run import Outcome, Run

PERCENTILES = (50, 90, 99)


def distribution(values_s: list[float]) -> dict[str, float]:
    """mean, p50, p90, p99, max in milliseconds (linear interpolation
    between ranks, as numpy does).
    """
    if not values_s:
        return {k: 0.0 for k in ("mean", "p50", "p90", "p99", "max")}
    xs = sorted(v * 1000.0 for v in values_s)

    def pct(p: float) -> float:
        k = (len(xs) - 1) * p / 100.0
        lo, hi = math.floor(k), math.ceil(k)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    out = {"mean": sum(xs) / len(xs)}
    out.update({f"p{p}": pct(p) for p in PERCENTILES})
    out["max"] = xs[-1]
    return out


def parse_slo(text: str | None) -> dict[str, float]:
    if not text:
        return {}
    slo = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            raise SystemExit(
                f"--slo: unknown figure {key!r} (use ttft_ms, tpot_ms, itl_ms, e2el_ms)"
            )
        slo[key] = float(value)
    return slo


def summarize(
    run: Run, duration: float, slo: dict[str, float], leaked: int | None, extra: dict
) -> dict:
    done = [o for o in run.outcomes if o.e2el is not None and not o.error and not o.aborted]
    failed = [o for o in run.outcomes if o.error]
    errors: dict[str, int] = {}
    for o in failed:
        errors[o.error] = errors.get(o.error, 0) + 1
    tpots = [(o.e2el - o.ttft) / (o.output_tokens - 1) for o in done if o.output_tokens > 1]
    out_tokens = sum(o.output_tokens for o in done)
    in_tokens = sum(o.input_len for o in done)

    def meets(o: Outcome) -> bool:
        tpot = (o.e2el - o.ttft) / (o.output_tokens - 1) if o.output_tokens > 1 else 0.0
        figures = {
            "ttft_ms": o.ttft * 1000,
            "e2el_ms": o.e2el * 1000,
            "tpot_ms": tpot * 1000,
            "itl_ms": max(o.itl, default=0.0) * 1000,
        }
        return all(figures[k] <= v for k, v in slo.items())

    result = {
        **extra,
        "completed": len(done),
        "failed": len(failed),
        "aborted": sum(o.aborted for o in run.outcomes),
        "errors": errors,
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "ttft_ms": distribution([o.ttft for o in done]),
        "tpot_ms": distribution(tpots),
        "itl_ms": distribution([g for o in done for g in o.itl]),
        "e2el_ms": distribution([o.e2el for o in done]),
    }
    if slo:
        result["slo"] = slo
        result["goodput"] = sum(meets(o) for o in done) / duration
    stats = [s for s in run.samples if "utilization" in s]
    if stats:
        dq = stats[-1]["prefix_queries"] - stats[0]["prefix_queries"]
        result["cache"] = {
            "peak_utilization": max(s["utilization"] for s in stats),
            "preemptions": stats[-1]["preemptions"] - stats[0]["preemptions"],
            "prefix_cache_hit_rate": (stats[-1]["prefix_hits"] - stats[0]["prefix_hits"]) / dq
            if dq
            else 0.0,
        }
    result["leaked_blocks"] = leaked
    result["timeline"] = run.samples
    return result


HEADLINE = [
    ("completed", "{:.0f}"),
    ("failed", "{:.0f}"),
    ("aborted", "{:.0f}"),
    ("duration_s", "{:.1f}"),
    ("request_throughput", "{:.2f}"),
    ("output_throughput", "{:.1f}"),
    ("total_token_throughput", "{:.1f}"),
    ("goodput", "{:.2f}"),
]
LATENCIES = ["ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"]


def block(r: dict) -> str:
    """One run, one figure a line (as vLLM's `bench serve` prints it)."""
    lines = [f"{'=' * 18} {r['label']} {'=' * 18}"]
    units = {
        "duration_s": "",
        "request_throughput": " req/s",
        "output_throughput": " tok/s",
        "total_token_throughput": " tok/s",
        "goodput": " req/s",
    }
    for key, fmt in HEADLINE:
        if key in r:
            name = key.removesuffix("_s").replace("_", " ") + (
                " (s)" if key == "duration_s" else ""
            )
            lines.append(f"{name:<28}{fmt.format(r[key]) + units.get(key, ''):>20}")
    if r["errors"]:
        lines.append(f"{'errors':<28}{json.dumps(r['errors']):>14}")
    for key in LATENCIES:
        d = r[key]
        lines.append(
            f"{key.removesuffix('_ms').upper() + ' (ms)':<14}"
            + "".join(f"{name} {d[name]:>9.1f}   " for name in ("mean", "p50", "p90", "p99", "max"))
        )
    cache = r.get("cache")
    if cache:
        lines.append(
            f"{'KV cache':<14}peak utilization {cache['peak_utilization']:.0%}, preemptions "
            f"{cache['preemptions']}, prefix-cache hit rate {cache['prefix_cache_hit_rate']:.0%}"
        )
    leaked = r["leaked_blocks"] if r["leaked_blocks"] is not None else "unknown"
    lines.append(f"{'leaked blocks':<28}{leaked:>14}")
    return "\n".join(lines)


def table(results: list[dict]) -> str:
    if len(results) == 1:
        return block(results[0])
    lines = []
    header = (
        f"{'run':<22}{'done':>6}{'fail':>6}{'req/s':>8}{'out tok/s':>11}"
        + "".join(f"{k.removesuffix('_ms') + ' p50/p99 ms':>22}" for k in LATENCIES)
        + f"{'peak KV':>9}{'leaked':>8}"
    )
    lines.append(header)
    for r in results:
        row = (
            f"{r['label']:<22}{r['completed']:>6}{r['failed']:>6}{r['request_throughput']:>8.2f}"
            f"{r['output_throughput']:>11.1f}"
        )
        for k in LATENCIES:
            row += f"{r[k]['p50']:>12.1f} /{r[k]['p99']:>8.1f}"
        cache = r.get("cache") or {}
        leaked = r["leaked_blocks"] if r["leaked_blocks"] is not None else "?"
        row += f"{cache.get('peak_utilization', 0) * 100:>8.0f}%{leaked:>8}"
        lines.append(row)
        if r.get("errors"):
            lines.append(f"{'':<22}errors: {r['errors']}")
        if "goodput" in r:
            lines.append(f"{'':<22}goodput {r['goodput']:.2f} req/s meeting {r['slo']}")
    return "\n".join(lines)


def compare(new: list[dict], old_path: Path) -> str:
    old = json.loads(old_path.read_text())
    old = old if isinstance(old, list) else [old]
    lines = [f"change against {old_path}:"]
    for a, b in zip(old, new, strict=False):
        parts = []
        for key, _ in HEADLINE:
            if key in a and key in b and isinstance(a[key], (int, float)) and a[key]:
                parts.append(f"{key} {b[key] / a[key] - 1:+.1%}")
        for key in LATENCIES:
            for p in ("p50", "p99"):
                if a[key][p]:
                    parts.append(f"{key.removesuffix('_ms')} {p} {b[key][p] / a[key][p] - 1:+.1%}")
        lines.append(f"  {b['label']}: " + ", ".join(parts))
    return "\n".join(lines)


def plot(results: list[dict], folder: Path) -> list[Path]:

    # one function: one figure, panel by panel
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for r in results:
        for ax, key in zip(axes, ("ttft_ms", "tpot_ms", "e2el_ms"), strict=True):
            xs = sorted(r["samples_ms"][key])
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=r["label"])
    for ax, key in zip(axes, ("TTFT", "TPOT", "E2E latency"), strict=True):
        ax.set_xlabel(f"{key} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    written.append(folder / "latency_cdf.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for r in results:
        tl = r["timeline"]
        ts = [s["t"] for s in tl]
        rates = [0.0] + [
            (b["output_tokens"] - a["output_tokens"]) / max(b["t"] - a["t"], 1e-9)
            for a, b in zip(tl, tl[1:], strict=False)
        ]
        ax1.plot(ts, rates, label=r["label"])
        ax2.plot(
            [s["t"] for s in tl if "utilization" in s],
            [s["utilization"] * 100 for s in tl if "utilization" in s],
        )
    ax1.set_ylabel("output tokens/s")
    ax2.set_ylabel("KV pool used (%)")
    ax2.set_xlabel("seconds into the run")
    ax1.legend(fontsize=7)
    fig.tight_layout()
    written.append(folder / "timeline.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    if len(results) > 1:
        curve = sorted(results, key=lambda r: r["output_throughput"])
        fig, ax = plt.subplots(figsize=(7, 5))
        ax.plot(
            [r["output_throughput"] for r in curve],
            [r["e2el_ms"]["p50"] / 1000 for r in curve],
            "o-",
            label="p50 E2E latency",
        )
        ax.plot(
            [r["output_throughput"] for r in curve],
            [r["ttft_ms"]["p99"] / 1000 for r in curve],
            "s--",
            label="p99 TTFT",
        )
        for r in curve:
            ax.annotate(
                r["label"], (r["output_throughput"], r["e2el_ms"]["p50"] / 1000), fontsize=7
            )
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel("seconds")
        ax.set_title("throughput against latency")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        written.append(folder / "sweep.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written

"""`pagedserve stats` and `pagedserve top`: the KV pool, its replicas and the requests holding the
most blocks, drawn with rich from one GetCacheStats reading (and, for rates, the previous one).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import grpc
from rich import box
from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from deploy.client import rpc_failure, stub_for
from protos.base.logs import human_bytes

# Colours of the pool's parts, in the bar and the legend.
COLORS = {"held": "red", "shared": "magenta", "cached": "yellow", "free": "green"}
MAX_REQUESTS = 10


@dataclass
class Reading:
    stats: object  # generation_pb2.CacheStats
    at: float  # time.monotonic() of the reading


def info_table(info, server: str) -> Table:
    """GetModelInfo as two columns: what a person asks of a server first."""
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    layout = (
        f"{info.data_parallel_size} replica(s) x {info.tensor_parallel_size} rank(s), "
        f"{info.num_workers} worker(s)"
    )
    rows = [
        ("server", server),
        ("model", info.model_name),
        ("task", info.task or "generate"),
        ("context", f"{info.max_context:,} tokens"),
        ("vocabulary", f"{info.vocab_size:,} tokens"),
        ("weights", info.dtype),
        (
            "KV pool",
            f"{info.num_blocks:,} blocks x {info.block_size} tokens ({info.kv_cache_dtype})",
        ),
        ("layout", layout),
        ("end tokens", ", ".join(str(t) for t in info.eos_token_ids) or "none"),
    ]
    if info.embedding_dimension:
        rows.append(
            (
                "embeddings",
                f"{info.embedding_dimension} values, {info.pooling} pooling"
                f"{', normalized' if info.normalized else ''}",
            )
        )
    if info.prompt_names:
        rows.append(("prompt names", ", ".join(info.prompt_names)))
    for a in info.lora_adapters:
        rows.append(("LoRA adapter", f"{a.name} (rank {a.rank}: {', '.join(a.target_modules)})"))
    for name, value in rows:
        t.add_row(name, value)
    return t


def pool_parts(s) -> dict[str, int]:
    """Blocks held by one sequence, shared by several, cached (free, reusable) and free (empty)."""
    held = s.num_blocks - s.num_free_blocks - s.num_cached_blocks
    return {
        "held": max(0, held - s.num_shared_blocks),
        "shared": s.num_shared_blocks,
        "cached": s.num_cached_blocks,
        "free": s.num_free_blocks,
    }


def pool_bar(s, width: int = 60) -> Text:
    """The pool as one bar, each part at least a cell when it has any block."""
    parts = pool_parts(s)
    total = max(1, s.num_blocks)
    cells = {k: (max(1, round(v / total * width)) if v else 0) for k, v in parts.items()}
    # rounding up small parts may overflow: take it from the largest
    while sum(cells.values()) > width:
        biggest = max(cells, key=cells.get)
        cells[biggest] -= 1
    cells["free"] += width - sum(cells.values())
    bar = Text()
    for name, n in cells.items():
        bar.append("█" * n, style=COLORS[name])
    return bar


def legend(s) -> Text:
    parts = pool_parts(s)
    out = Text()
    for name, n in parts.items():
        out.append("■ ", style=COLORS[name])
        out.append(f"{name} {n:,} ({human_bytes(n * s.bytes_per_block)})  ")
    return out


def hit_rate(s) -> str:
    return f"{s.prefix_cache_hits / s.prefix_cache_queries:.1%}" if s.prefix_cache_queries else "–"


def rates(now: Reading, before: Reading | None) -> tuple[float | None, float | None]:
    """(generated tokens/s, prompt tokens/s) between two readings; None without a previous one."""
    if before is None or now.at <= before.at:
        return None, None
    dt = now.at - before.at
    return (
        (now.stats.num_generated_tokens - before.stats.num_generated_tokens) / dt,
        (now.stats.num_prompt_tokens_computed - before.stats.num_prompt_tokens_computed) / dt,
    )


def summary_table(s, gen_rate: float | None = None, prompt_rate: float | None = None) -> Table:
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column(justify="right")
    t.add_column(style="bold")
    t.add_column(justify="right")
    held = s.num_blocks - s.num_free_blocks - s.num_cached_blocks
    t.add_row(
        "blocks",
        f"{s.num_blocks:,} x {s.block_size} tokens",
        "memory",
        f"{human_bytes(s.used_bytes)} / {human_bytes(s.total_bytes)}",
    )
    t.add_row(
        "held", f"{held:,} ({s.num_shared_blocks:,} shared)", "utilization", f"{s.utilization:.1%}"
    )
    t.add_row(
        "cached",
        f"{s.num_cached_blocks:,}",
        "prefix hit rate",
        f"{hit_rate(s)} of {s.prefix_cache_queries:,} tokens",
    )
    t.add_row("free", f"{s.num_free_blocks:,}", "preemptions", f"{s.num_preemptions:,}")
    t.add_row("running", f"{s.num_running:,}", "waiting", f"{s.num_waiting:,}")
    if s.num_state_slots:  # a hybrid's recurrent-state pool beside the KV pool
        t.add_row(
            "state slots",
            f"{s.num_used_state_slots:,} / {s.num_state_slots:,}",
            "state memory",
            human_bytes(s.num_state_slots * s.bytes_per_state_slot),
        )
        t.add_row("state snapshots", f"{s.num_state_snapshots:,}", "", "")
    for name in ("host", "disk"):  # the KV tiers under the pool, where there are
        if cap := getattr(s, f"{name}_tier_capacity"):
            held = getattr(s, f"{name}_tier_blocks")
            t.add_row(
                f"{name} tier",
                f"{held:,} / {cap:,} ({human_bytes(held * s.bytes_per_block)})",
                "loaded / stored",
                f"{getattr(s, f'{name}_tier_loaded'):,} / "
                f"{getattr(s, f'{name}_tier_stored'):,} blocks",
            )
    if s.kv_load_failures:
        t.add_row("", "", "failed loads", f"{s.kv_load_failures:,} (computed instead)")
    if gen_rate is not None:
        t.add_row("tokens/s", f"{gen_rate:,.1f}", "prompt tokens/s", f"{prompt_rate:,.1f}")
    else:
        t.add_row(
            "generated",
            f"{s.num_generated_tokens:,} tokens",
            "prompt computed",
            f"{s.num_prompt_tokens_computed:,} tokens",
        )
    return t


def replica_table(s) -> Group | None:
    """A row a replica within 80 columns, then why each down one is down."""
    if len(s.replicas) < 2 and all(r.serving for r in s.replicas):
        return None
    t = Table(
        title="replicas",
        title_justify="left",
        expand=False,
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        pad_edge=False,
        show_edge=False,
    )
    for col in ("#", "status", "util", "held", "cached", "free", "hits", "run/wait", "requests"):
        t.add_column(col, justify="left" if col == "status" else "right", no_wrap=True)
    reasons = []
    for r in s.replicas:
        held = r.num_blocks - r.num_free_blocks - r.num_cached_blocks
        status = Text("serving", style="green") if r.serving else Text("down", style="red")
        if not r.serving:
            reasons.append(Text(f"replica {r.replica}: {r.status or 'down'}", style="red"))
        t.add_row(
            str(r.replica),
            status,
            f"{r.utilization:.0%}",
            f"{held:,}",
            f"{r.num_cached_blocks:,}",
            f"{r.num_free_blocks:,}",
            hit_rate(r),
            f"{r.num_running}/{r.num_waiting}",
            f"{r.num_requests:,}",
        )
    return Group(t, *reasons)


def request_table(s, limit: int = MAX_REQUESTS) -> Table:
    top = sorted(s.requests, key=lambda r: (-r.num_blocks, r.request_id))[:limit]
    hidden = any(not r.request_id for r in top)
    note = "; ids shown with --expose-request-ids" if hidden else ""
    t = Table(
        title=f"requests holding the most blocks ({len(top)} of {len(s.requests)} live{note})",
        title_justify="left",
    )
    for col in ("request", "replica", "blocks", "tokens", "memory"):
        t.add_column(col, justify="left" if col == "request" else "right")
    for r in top:
        t.add_row(
            r.request_id or "–",
            str(r.replica),
            f"{r.num_blocks:,}",
            f"{r.num_tokens:,}",
            human_bytes(r.num_bytes),
        )
    return t


def stats_view(s) -> Group:
    parts = [summary_table(s), Text(), pool_bar(s), legend(s)]
    replicas = replica_table(s)
    if replicas is not None:
        parts += [Text(), replicas]
    parts += [Text(), request_table(s, limit=20)]
    return Group(*parts)


def top_view(now: Reading, before: Reading | None, server: str, model: str) -> Panel:
    s = now.stats
    gen, prompt = rates(now, before)
    parts = [pool_bar(s, width=64), legend(s), Text(), summary_table(s, gen, prompt)]
    replicas = replica_table(s)
    if replicas is not None:
        parts += [Text(), replicas]
    parts += [Text(), request_table(s)]
    stamp = time.strftime("%H:%M:%S")
    return Panel(
        Group(*parts),
        title=f"pagedserve top — {model} @ {server}",
        subtitle=f"{stamp}  ctrl-c quits",
        expand=False,
    )


def cmd_stats(args: argparse.Namespace) -> int:
    from google.protobuf import json_format

    from protos import generation_pb2

    try:
        stats = stub_for(args.server, args.tls_ca, args.api_key).GetCacheStats(
            generation_pb2.GetCacheStatsRequest(), timeout=args.timeout
        )
    except grpc.RpcError as e:
        print(f"error: {rpc_failure(e, args.server)}", file=sys.stderr)
        return 1
    if args.json:
        print(json_format.MessageToJson(stats, always_print_fields_with_no_presence=True))
        return 0
    from rich.console import Console

    Console().print(stats_view(stats))
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    import time

    from rich.console import Console
    from rich.live import Live

    from protos import generation_pb2

    stub = stub_for(args.server, args.tls_ca, args.api_key)
    console = Console()
    try:
        model = stub.GetModelInfo(
            generation_pb2.GetModelInfoRequest(), timeout=args.timeout
        ).model_name
    except grpc.RpcError as e:
        print(f"error: {rpc_failure(e, args.server)}", file=sys.stderr)
        return 1
    # a first reading before the first frame, so rates show from the start
    before = Reading(
        stub.GetCacheStats(generation_pb2.GetCacheStatsRequest(), timeout=args.timeout),
        time.monotonic(),
    )
    time.sleep(min(args.interval, 0.5))
    # a pipe or a file: each frame printed whole, one after another (top -b)
    if not console.is_terminal:
        return _top_frames(args, stub, console, before, model)
    drawn = 0
    view = None
    try:
        with Live(
            console=console, auto_refresh=False, screen=not args.no_screen, transient=False
        ) as live:
            while args.iterations is None or drawn < args.iterations:
                try:
                    now = Reading(
                        stub.GetCacheStats(
                            generation_pb2.GetCacheStatsRequest(), timeout=args.timeout
                        ),
                        time.monotonic(),
                    )
                    view = top_view(now, before, args.server, model)
                    live.update(view, refresh=True)
                    before = now
                except grpc.RpcError as e:  # a restarting server: say so and keep trying
                    from rich.text import Text

                    live.update(
                        Text(
                            f"{args.server}: {e.code().name}: {e.details()} (retrying)", style="red"
                        ),
                        refresh=True,
                    )
                drawn += 1
                if args.iterations is None or drawn < args.iterations:
                    time.sleep(args.interval)
    except KeyboardInterrupt:
        pass
    if args.svg and view is not None:  # the last frame as a picture (docs/top.svg is one)
        import io

        recorder = Console(record=True, width=110, file=io.StringIO())
        recorder.print(view)
        recorder.save_svg(args.svg, title="pagedserve top")
    return 0


def _top_frames(args: argparse.Namespace, stub, console, before, model: str) -> int:
    import time

    from protos import generation_pb2

    drawn = 0
    while args.iterations is None or drawn < args.iterations:
        if drawn:
            time.sleep(args.interval)
        try:
            now = Reading(
                stub.GetCacheStats(generation_pb2.GetCacheStatsRequest(), timeout=args.timeout),
                time.monotonic(),
            )
        except grpc.RpcError as e:
            print(f"error: {rpc_failure(e, args.server)}", file=sys.stderr)
            return 1
        console.print(top_view(now, before, args.server, model))
        console.file.flush()
        before = now
        drawn += 1
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from google.protobuf import json_format

    from protos import generation_pb2

    stub = stub_for(args.server, args.tls_ca, args.api_key)
    info = stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=args.timeout)
    if args.json:
        print(json_format.MessageToJson(info, always_print_fields_with_no_presence=True))
        return 0
    from rich.console import Console

    Console().print(info_table(info, args.server))
    return 0

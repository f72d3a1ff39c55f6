"""The scheduler's command line: its flags, the frozen config they make, and the model folder they
name, checked before anything starts (one line saying what is wrong, never a traceback).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from protos.base import ConfigError, env
from protos.base.argtypes import COUNT, PORT, PORT_OR_ANY, POSITIVE, SECONDS, float_range, int_range
from protos.base.logs import LOG_FORMATS
from scheduler_service.api.front_doors import DEFAULT_HTTP_PORT
from scheduler_service.core.adapters import (
    AdapterError,
    AdapterRegistry,
    BaseShapes,
    parse_module_flag,
)
from scheduler_service.core.config import TASKS, ModelSpec, SchedulerConfig
from scheduler_service.core.pooling import POOLINGS


def add_scheduler_args(p: argparse.ArgumentParser) -> None:
    # one function: the scheduler's flag table
    p.add_argument(
        "--model",
        required=True,
        help="a model folder (config.json, tokenizer.json, weights) or a .gguf file",
    )
    p.add_argument(
        "--task",
        choices=TASKS,
        default="auto",
        help="generate, embed (Embed; /v1/embeddings) or both (in the same steps); auto: embed "
        "where the folder has sentence-transformers' modules.json, else generate",
    )
    p.add_argument(
        "--pooling",
        choices=POOLINGS,
        default=None,
        help="how an embedding model's hidden states pool (default: the folder's, else last)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the name(s) OpenAI requests give as `model` (default: the model folder's name)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address both ports listen on (0.0.0.0: every interface)",
    )
    p.add_argument(
        "--port", type=PORT, default=50051, help="gRPC port (0: any free one; see --port-file)"
    )
    p.add_argument(
        "--http-port",
        type=PORT_OR_ANY,
        default=None,
        help=f"OpenAI-compatible HTTP port (default {DEFAULT_HTTP_PORT}, left off with a warning "
        "where it is taken; a port given here and taken is an error; 0: off; -1: any free "
        "port, written to --port-file)",
    )
    p.add_argument(
        "--api-key",
        default=env.api_key(),
        help="require this key on every API: `Authorization: Bearer KEY` on HTTP (or Anthropic's "
        "`x-api-key: KEY`), metadata `authorization: Bearer KEY` on gRPC; health checks stay "
        "open (default: $PAGEDSERVE_API_KEY; unset: no key)",
    )
    p.add_argument(
        "--max-tokens-default",
        type=COUNT,
        default=1024,
        help="max_tokens of a request that names none (within what its prompt leaves of the "
        "context; 0: up to the end of the context)",
    )
    p.add_argument(
        "--port-file",
        default=None,
        help='once bound, write {"port": gRPC port, "worker_endpoint": ZeroMQ endpoint} as '
        "JSON to this file (with --port 0 and a worker endpoint on port 0: how a script or "
        "test learns them without racing another process for a port)",
    )
    p.add_argument(
        "--worker-endpoint",
        default="tcp://127.0.0.1:0",
        help="ZeroMQ endpoint workers connect to (loopback unless --curve-keys or --insecure-wire)",
    )
    p.add_argument(
        "--curve-keys",
        default=None,
        help="folder made by `pagedserve keys`: encrypt the wire and accept only workers with its "
        "keys",
    )
    p.add_argument(
        "--insecure-wire",
        action="store_true",
        help="allow a non-loopback worker endpoint without CurveZMQ (anyone reaching it can act "
        "as a worker)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "--tp",
        type=POSITIVE,
        default=1,
        dest="tensor_parallel_size",
        help="ranks of one model (heads, MLP and vocabulary split over them)",
    )
    p.add_argument(
        "--data-parallel-size",
        "--dp",
        type=POSITIVE,
        default=1,
        dest="data_parallel_size",
        help="replicas of the model, each a tensor-parallel group with its own KV pool",
    )
    p.add_argument(
        "--route-overload-slack",
        type=COUNT,
        default=None,
        help="data parallel: extra load (waiting x 4 + running) the replica holding a request's "
        "cached prefix may carry over the least loaded one and still get it (default: "
        "max-num-seqs / 4)",
    )
    p.add_argument(
        "--block-size", type=POSITIVE, default=16, help="tokens per KV block (a power of two)"
    )
    p.add_argument(
        "--max-num-seqs",
        type=POSITIVE,
        default=None,
        help="most sequences in a step (default: what the workers propose: 64 on a CPU, from the "
        "KV pool's capacity on a GPU)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=POSITIVE,
        default=2048,
        help="per-step token budget: decodes first, then prompt chunks",
    )
    p.add_argument(
        "--no-chunked-prefill",
        action="store_true",
        help="prefill whole prompts in one step (needs --max-num-batched-tokens >= the context)",
    )
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="never reuse computed blocks across requests",
    )
    p.add_argument(
        "--max-model-len", type=int_range(2), default=None, help="cap the model's context"
    )
    p.add_argument(
        "--no-overlap",
        action="store_true",
        help="plan each step only after the previous one's result (default: plan the next step "
        "while the workers run this one)",
    )
    p.add_argument(
        "--max-queue-len",
        type=POSITIVE,
        default=1024,
        help="requests that may wait; more are refused (RESOURCE_EXHAUSTED, HTTP 429)",
    )
    p.add_argument(
        "--speculative",
        choices=("auto", "ngram", "off"),
        default="auto",
        help="speculative decoding: draft tokens from each sequence's own n-grams (and earlier "
        "requests') and verify them in one step, the same answers in fewer steps. auto: "
        "only in steps of at most --speculative-max-rows decodes and no prompt to compute, and "
        "only as far as the tokens likely to stand repay a drafted row's cost measured from the "
        "steps (a MoE's drafted tokens read other experts: there only long, reliable matches "
        "draft); ngram: every match, in every step; off",
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=POSITIVE,
        default=10,
        help="the longest draft (made after a suffix match of 6 tokens or more)",
    )
    p.add_argument(
        "--speculative-max-rows",
        type=COUNT,
        default=4,
        help="with --speculative auto: steps of more decodes than this (or with a prompt to "
        "compute) draft nothing",
    )
    p.add_argument(
        "--embed-slowdown",
        type=float_range(0.0, 1.0, low_open=True),
        default=0.2,
        help="embeddings beside generation: the share of their speed decoding streams may lose to "
        "embedding chunks in their steps (1: embeddings are not held back)",
    )
    p.add_argument(
        "--embed-step-tokens",
        type=COUNT,
        default=512,
        help="with --task both: the most embedding tokens a step without decodes takes (bounds "
        "how long a new generation request waits behind embeddings; 0: the whole budget)",
    )
    p.add_argument(
        "--max-decode-gap-ms",
        type=COUNT,
        default=500,
        help="while prompts are computed beside decoding streams, each stream's next token comes "
        "within about this many milliseconds: prompt chunks are sized from the measured cost of a "
        "token, the rest in later steps; the prompts get at least a decode-only step's time, more "
        "where more requests wait for a first token than stream, so the gap gives way where a "
        "decode-only step takes over half of it (0: chunks fill --max-num-batched-tokens)",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) served beside the base model, each under its name: a "
        "request's lora (OpenAI: model) picks one; more load at run time (LoadLoraAdapter)",
    )
    p.add_argument(
        "--max-loras",
        type=POSITIVE,
        default=8,
        help="the most LoRA adapters whose requests run at once (a request whose adapter would be "
        "one more waits); no more than the workers keep (--max-cpu-loras)",
    )
    p.add_argument(
        "--debug-invariants", action="store_true", help="check allocator invariants every step"
    )
    p.add_argument(
        "--step-profile-interval",
        type=SECONDS,
        default=5.0,
        help="seconds between step_profile log lines (where a busy replica's step time went)",
    )
    p.add_argument(
        "--worker-timeout", type=SECONDS, default=300.0, help="seconds to wait for workers at start"
    )
    p.add_argument(
        "--heartbeat-timeout",
        type=SECONDS,
        default=10.0,
        help="seconds of silence after which a worker counts as lost (stopped, hung or "
        "unreachable)",
    )
    p.add_argument(
        "--step-timeout",
        type=SECONDS,
        default=60.0,
        help="step watchdog: a step of T tokens that takes longer than this + T x "
        "--step-timeout-per-token seconds declares its workers lost (they are fenced and "
        "replaced)",
    )
    p.add_argument(
        "--step-timeout-per-token",
        type=float_range(0.0),
        default=0.05,
        help="seconds the step watchdog allows per token of a step, beyond --step-timeout",
    )
    p.add_argument(
        "--drain-timeout",
        type=float_range(0.0),
        default=30.0,
        help="on SIGTERM/SIGINT: seconds running requests get to finish before they end with "
        "UNAVAILABLE",
    )
    p.add_argument(
        "--worker-restart-timeout",
        type=SECONDS,
        default=120.0,
        help="seconds a lost replica's requests wait for a worker group to (re)join before they "
        "end with UNAVAILABLE (with data parallelism they move to another replica at once)",
    )
    p.add_argument(
        "--tls-cert", default=None, help="serve gRPC over TLS with this certificate chain (PEM)"
    )
    p.add_argument("--tls-key", default=None, help="the private key (PEM) of --tls-cert")
    p.add_argument(
        "--expose-request-ids",
        action="store_true",
        help="show request ids in GetCacheStats (anyone who sees an id can abort its request)",
    )
    p.add_argument(
        "--metrics-port",
        type=PORT_OR_ANY,
        default=None,
        help="serve Prometheus metrics on this port (default 9090, left off with a warning where "
        "it is taken; 0: off; -1: any free port, written to --port-file)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="the least severe log events written",
    )
    p.add_argument(
        "--log-format",
        default="auto",
        choices=LOG_FORMATS,
        help="console: readable lines; json: one JSON object a line; auto: console on a terminal",
    )


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs or min(64, args.max_num_batched_tokens),
        auto_max_num_seqs=args.max_num_seqs is None,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=not args.no_chunked_prefill,
        enable_prefix_caching=not args.no_prefix_caching,
        max_queue_len=args.max_queue_len,
        debug_invariants=args.debug_invariants,
        step_profile_interval=args.step_profile_interval,
        overlap=not args.no_overlap,
        route_overload_slack=args.route_overload_slack,
        speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        speculative_max_rows=args.speculative_max_rows,
        embed_slowdown=args.embed_slowdown,
        embed_step_tokens=args.embed_step_tokens,
        max_decode_gap=args.max_decode_gap_ms / 1000.0,
        default_max_tokens=args.max_tokens_default,
        max_loras=args.max_loras,
    )


def lora_registry(args: argparse.Namespace, base_names: tuple[str, ...]) -> AdapterRegistry | None:
    """--lora-modules checked against the model or ConfigError; None without shapes."""
    try:
        base = BaseShapes.from_config(json.loads((Path(args.model) / "config.json").read_text()))
    except (KeyError, TypeError, ValueError, OSError) as e:
        if args.lora_modules:
            raise ConfigError(
                f"{args.model}/config.json does not give the shapes LoRA needs: {e}"
            ) from None
        return None
    registry = AdapterRegistry(base, base_names, getattr(args, "max_lora_rank", None))
    try:
        for name, path in parse_module_flag(args.lora_modules or []):
            registry.load(name, path)
    except (AdapterError, OSError) as e:
        raise ConfigError(str(e)) from None
    return registry


def check_model_folder(path: str) -> None:
    """ConfigError saying what is wrong where --model names no model folder."""
    folder = Path(path)
    expected = "expected a model folder (config.json, tokenizer.json, weights) or a .gguf file"
    if not folder.exists():
        raise ConfigError(f"no model at {path}: {expected}")
    if not folder.is_dir():
        raise ConfigError(f"{path} is a file but not a .gguf one: {expected}")
    for name in ("config.json", "tokenizer.json"):
        if not (folder / name).is_file():
            raise ConfigError(f"{path} has no {name}: {expected}")


def served_names(args: argparse.Namespace, spec: ModelSpec) -> list[str]:
    """--served-model-name, else the folder's name less a prepared GGUF folder's hash."""
    if args.served_model_name:
        return args.served_model_name
    folder = Path(spec.path or args.model)
    if (folder / "pagedserve_model.json").is_file():
        return [re.sub(r"-[0-9a-f]{12}$", "", folder.name)]
    return [folder.name]

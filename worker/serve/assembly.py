"""The worker's last start-up phases: the KV pool sized (by flag, or on CUDA from what is left once
all else is measured), the runner built and warmed, and the handshake that offers it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import structlog

from protos.base.argtypes import parse_bytes
from worker.serve.choices import kv_budget_bytes
from worker.serve.config import Refused, WorkerConfig
from worker.serve.kv_offload import fingerprint, tier_store
from worker.serve.startup import Loaded

log = structlog.get_logger("worker.serve.main")


@dataclass
class PoolPlan:
    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_num_seqs: int
    use_graphs: bool
    graph_context: list[int]
    # a hybrid's recurrent-state slots (one per running sequence) and their bytes each; 0 for others
    state_slots: int = 0
    bytes_per_state_slot: int = 0
    max_context: int = 0  # the longest request this rank serves (0: the model's)


def size_pool(cfg: WorkerConfig, loaded: Loaded, device, tp: int) -> PoolPlan:
    """Phase 3: pool blocks (on CUDA, what is left after measuring), sequences a step, graphs."""
    import torch

    from worker.model.kv_pool import bytes_per_block
    from worker.serve.sizing import (
        GPU_MAX_NUM_SEQS,
        default_max_num_seqs,
        gpu_blocks,
        lora_reserve,
        measure_graph_bytes,
        profile_gpu_peak,
    )

    config, attn = loaded.config, loaded.attn
    per_block = bytes_per_block(config, cfg.block_size, loaded.kv_dtype, loaded.model.shard.size)
    # graphs capture the triton backend's step; torch's reads lengths on the host, which capture
    # cannot hold
    use_graphs = (
        device.type == "cuda"
        and not cfg.enforce_eager
        and tp == 1
        and attn.name == "triton"
        and not config.keeps_state
    )
    if device.type == "cuda" and not cfg.enforce_eager and config.keeps_state:
        log.info("decode_graphs_off", reason="a hybrid's state slots are not captured yet")
    if device.type == "cuda" and not cfg.enforce_eager and attn.name != "triton":
        log.info(
            "decode_graphs_off",
            reason=f"the {attn.name} attention backend syncs with the host each step",
        )
    if device.type == "cuda" and not cfg.enforce_eager and tp > 1:
        # collectives inside a captured graph are not covered yet: TP groups decode eagerly
        log.info("decode_graphs_off", reason="tensor parallel")
    model_len = min(
        config.max_position_embeddings, cfg.max_model_len or config.max_position_embeddings
    )
    # a long tier where longer
    graph_context = sorted({min(model_len, cfg.graph_max_context), model_len})
    # the most rows a step may hold, which the sampler and graphs are measured at
    rows_bound = min(cfg.max_num_seqs or GPU_MAX_NUM_SEQS[1], cfg.max_num_batched_tokens)
    # LoRA and a hybrid's state slots: from the pool's budget
    lora = lora_reserve(cfg, loaded.config, loaded.model.shard, loaded.dtype)
    budget = (
        None
        if cfg.num_blocks
        else parse_bytes(cfg.kv_cache_memory)
        if cfg.kv_cache_memory
        else kv_budget_bytes(cfg, config, loaded.kv_dtype)
        if device.type == "cpu"
        else None
    )
    live, state_slots, per_slot = hybrid_slots(
        cfg, config, loaded.dtype, device, GPU_MAX_NUM_SEQS[1], tp, budget
    )
    lora += state_slots * per_slot
    try:
        if cfg.num_blocks:
            num_blocks = cfg.num_blocks
        elif cfg.kv_cache_memory:
            num_blocks = (parse_bytes(cfg.kv_cache_memory) - lora) // per_block
        elif device.type == "cuda":
            non_kv = profile_gpu_peak(
                loaded.model,
                attn,
                device,
                loaded.kv_dtype,
                cfg.block_size,
                cfg.max_num_batched_tokens,
                rows_bound,
            )
            graph_bytes = (
                measure_graph_bytes(
                    loaded.model,
                    attn,
                    device,
                    loaded.kv_dtype,
                    cfg.block_size,
                    rows_bound,
                    graph_context,
                )
                if use_graphs
                else 0
            )
            non_kv += graph_bytes + lora
            num_blocks = gpu_blocks(device, cfg.gpu_memory_utilization, non_kv, per_block)
            log.info(
                "gpu_memory_budget",
                non_kv_bytes=non_kv,
                graph_bytes=graph_bytes,
                lora_bytes=lora,
                bytes_per_block=per_block,
                num_blocks=num_blocks,
                utilization=cfg.gpu_memory_utilization,
            )
        else:
            num_blocks = (kv_budget_bytes(cfg, config, loaded.kv_dtype) - lora) // per_block
    except torch.cuda.OutOfMemoryError as e:
        raise Refused(
            "profile_out_of_memory",
            "out of GPU memory while measuring the largest step: lower "
            "--max-num-batched-tokens or --max-num-seqs, or raise --gpu-memory-utilization "
            f"({e})",
            error=str(e),
        ) from None
    if num_blocks < 1:
        beside = (
            f" beside {state_slots * per_slot} bytes of recurrent state ({state_slots} slots, "
            "--max-num-seqs and --state-snapshots)"
            if state_slots
            else f" beside {lora} bytes of LoRA adapters (--max-cpu-loras x --max-lora-rank)"
            if lora
            else ""
        )
        raise Refused(
            "kv_budget_too_small",
            f"the KV budget holds no block of {per_block} bytes{beside}: "
            "give --kv-cache-memory (or --num-blocks, --gpu-memory-utilization) more",
            kv_cache_memory=cfg.kv_cache_memory,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            bytes_per_block=per_block,
        )
    max_num_seqs = live or (
        cfg.max_num_seqs
        or default_max_num_seqs(device.type, num_blocks, cfg.block_size, cfg.max_num_batched_tokens)
    )
    return PoolPlan(
        num_blocks,
        cfg.block_size,
        per_block,
        max_num_seqs,
        use_graphs,
        graph_context,
        state_slots,
        per_slot,
        served_context(cfg, config, device, num_blocks),
    )


def served_context(cfg: WorkerConfig, config, device, num_blocks: int) -> int:
    """The model's context, or, on a CPU at every default (no --max-model-len, --kv-cache-memory
    or --num-blocks) where the default pool cannot grow to it, what the pool holds: served
    shorter, said in the log, rather than refused (a file's header may give a context no one
    trained: llama.cpp writes 2^20 for Mamba2 hybrids).
    """
    length = config.max_position_embeddings
    held = num_blocks * cfg.block_size
    explicit = cfg.max_model_len or cfg.kv_cache_memory or cfg.num_blocks
    if device.type != "cpu" or explicit or config.max_window or held >= length:
        return length
    log.info(
        "context_capped",
        max_context=held,
        model_context=length,
        why="the default pool holds no more beside the weights; --max-model-len or "
        "--kv-cache-memory choose otherwise",
    )
    return held


def hybrid_slots(
    cfg: WorkerConfig, config, dtype, device, gpu_rows: int, tp: int, budget: int | None
) -> tuple[int, int, int]:
    """A hybrid's running sequences, state slots and bytes a slot, within half the pool budget;
    zeros without recurrent state.
    """
    from worker.model.state_pool import bytes_per_slot

    if not config.keeps_state:
        return 0, 0, 0
    per_slot = bytes_per_slot(config, dtype, tp)
    live = cfg.max_num_seqs or (32 if device.type == "cpu" else gpu_rows)
    if not cfg.max_num_seqs and budget:
        fit = budget // 2 // per_slot - (cfg.state_snapshots or 0)
        chosen = max(1, min(live, fit // (2 if cfg.state_snapshots is None else 1)))
        if chosen < live:
            log.info("hybrid_max_num_seqs", max_num_seqs=chosen, bytes_per_state_slot=per_slot)
        live = chosen
    snapshots = live if cfg.state_snapshots is None else cfg.state_snapshots
    return live, live + snapshots, per_slot


def build_runner(loaded: Loaded, plan: PoolPlan, device, cfg: WorkerConfig | None = None):
    """Phase 4: pool allocated, runner warmed, graphs captured -> (runner, warm-up seconds)."""
    from worker.model.kv_pool import KVPool
    from worker.serve.memory_plan import available_bytes, resident_bytes
    from worker.serve.sizing import lora_cache
    from worker.step.runner import ModelRunner
    from worker.step.staging import is_device_fatal
    from worker.step.warm_up import warm_up

    if device.type == "cpu":
        from worker.serve.host_memory import huge_pages, release_free_memory, weight_tensors

        release_free_memory()
    # weights (and their copies), libraries: everything but the pool
    model_resident, _ = resident_bytes()
    pool = KVPool(
        loaded.config,
        plan.num_blocks,
        plan.block_size,
        loaded.kv_dtype,
        device,
        loaded.model.shard.size,
    )
    if plan.state_slots:
        from worker.model.state_pool import StatePool

        size = loaded.model.shard.size
        pool.states = StatePool(loaded.config, plan.state_slots, loaded.dtype, device, size)
        log.info(
            "state_pool",
            slots=plan.state_slots,
            bytes_per_slot=plan.bytes_per_state_slot,
            stateful_layers=len(pool.states.layers),
        )
    # what this worker will hold: the model as loaded, and the pool (paged in as used)
    if device.type == "cpu":
        rss, peak = resident_bytes()
        pool_bytes = plan.num_blocks * plan.bytes_per_block
        log.info(
            "host_memory",
            model_resident_bytes=model_resident,
            kv_pool_bytes=pool_bytes,
            planned_bytes=model_resident + pool_bytes,
            peak_resident_bytes=peak,
            resident_bytes=rss,
            available_bytes=available_bytes(),
        )
        # weights only: an advised pool faults in 2 MiB at a time (a 16-stream run lost a quarter)
        t0 = time.perf_counter()
        advised = huge_pages(weight_tensors(loaded.model), collapse=True)
        log.info("huge_pages", weights_bytes=advised, seconds=round(time.perf_counter() - t0, 2))
    runner = ModelRunner(loaded.model, pool, loaded.attn, device)
    if cfg is not None and cfg.max_cpu_loras:
        runner.adapters = lora_cache(cfg, loaded.config, loaded.model.shard, loaded.dtype, device)
    if cfg is not None and (cfg.kv_offload_size or cfg.kv_offload_dir):
        runner.tiers = tier_store(cfg, loaded, pool)
    warm_s = warm_up(runner)
    if plan.use_graphs:
        from worker.step.graphs import DecodeGraphs

        try:
            runner.graphs = DecodeGraphs(
                loaded.model,
                pool,
                loaded.attn,
                device,
                max_rows=plan.max_num_seqs,
                max_context=plan.graph_context,
            )
            runner.graphs.capture_all()
        except Exception as e:  # noqa: BLE001 - the budget or the model is wrong: say so and stop
            # fatal: the pool's budget set the graphs' memory aside
            if is_device_fatal(e):
                raise
            raise Refused(
                "decode_graphs_failed",
                f"capturing the decode graphs failed ({e!r}); lower --gpu-memory-utilization or "
                "--max-num-seqs, or pass --enforce-eager to decode without graphs",
                error=repr(e),
                max_num_seqs=plan.max_num_seqs,
            ) from None
    return runner, warm_s


def handshake_for(cfg: WorkerConfig, loaded: Loaded, plan: PoolPlan, device, tp: int):
    """Phase 5: what this rank tells the scheduler it is."""
    from protos import wire_pb2

    config = loaded.config
    return wire_pb2.Handshake(
        tp_rank=cfg.rank,
        tp_size=tp,
        replica=cfg.replica,
        rendezvous=cfg.rendezvous,
        num_blocks=plan.num_blocks,
        block_size=cfg.block_size,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_num_seqs=plan.max_num_seqs,
        kv_window=config.max_window,
        model_fingerprint=fingerprint(cfg, loaded),
        vocab_size=config.vocab_size,
        max_context=plan.max_context or config.max_position_embeddings,
        bytes_per_block=plan.bytes_per_block,
        state_slots=plan.state_slots,
        bytes_per_state_slot=plan.bytes_per_state_slot,
        num_kv_heads=loaded.heads,
        device=str(device),
        dtype=str(loaded.weights_dtype).removeprefix("torch."),
        kv_cache_dtype=str(loaded.kv_dtype).removeprefix("torch."),
        attention_backend=loaded.attn.name,
        weights=loaded.weights,
        lora_slots=cfg.max_cpu_loras or 0,
        max_lora_rank=cfg.max_lora_rank,
        pid=os.getpid(),
    )

"""The warm-up a worker runs before it serves: kernels compiled, libraries tuned and allocators warm
before the first request, not during it."""

from __future__ import annotations

import time

import numpy as np
import structlog

from protos.codec import PlanArrays, encode_plan
from worker.step.runner import ModelRunner
from worker.step.staging import is_device_fatal

log = structlog.get_logger("worker.step.runner")


def warm_up(runner: ModelRunner) -> float:
    """Three small steps before serving so kernels compile and allocators warm -> seconds."""
    bs = runner.pool.block_size
    per_seq = -(-5 // bs)  # blocks for 5 positions
    states = runner.pool.states  # a hybrid's rows each take a slot (reset, as they start at 0)
    if runner.pool.num_blocks < 2 * per_seq or (states is not None and states.num_slots < 2):
        return 0.0
    tables = np.arange(2 * per_seq, dtype=np.int32).reshape(2, per_seq)
    # (sequence, first position, new tokens) of each row, per step
    steps = [[(0, 0, 3), (1, 0, 2)], [(0, 3, 1), (1, 2, 2)], [(0, 4, 1), (1, 4, 1)]]
    kept = runner.chain.state()
    t0 = time.perf_counter()
    # non-finite logits (a broken checkpoint) fail here as on every step:
    try:
        # the steps report it to the scheduler; the warm-up only says so in the log
        for rows in steps:
            positions = np.concatenate([np.arange(a, a + n) for _, a, n in rows]).astype(np.int32)
            owner = np.repeat([r for r, _, _ in rows], [n for _, _, n in rows])
            plan = PlanArrays(
                step_id=(1 << 63) - 1,
                token_ids=(positions + 1).astype(np.int32),
                positions=positions,
                slot_mapping=tables[owner, positions // bs].astype(np.int64) * bs + positions % bs,
                block_tables=tables,
                seq_lens=np.array([a + n for _, a, n in rows], dtype=np.int32),
                query_start_loc=np.cumsum([0] + [n for _, _, n in rows]).astype(np.int32),
                do_sample=np.ones(2, dtype=bool),
                sample_index=np.zeros(2, dtype=np.int32),
                temperature=np.array([0.0, 1.0], dtype=np.float32),
                top_p=np.array([1.0, 0.9], dtype=np.float32),
                top_k=np.array([0, 5], dtype=np.int32),
                seed=np.zeros(2, dtype=np.uint64),
                block_copies=np.zeros((0, 2), dtype=np.int32),
                state_slots=np.arange(2, dtype=np.int32) if states is not None else None,
            )
            result = runner.execute(encode_plan(plan))
            if result.error:
                log.warning("warm_up_step_failed", error=result.error)
                break
    # noqa: BLE001 - any failure but a device's own is left to the steps to report
    except Exception as e:
        if is_device_fatal(e):
            raise
        log.warning("warm_up_step_failed", error=repr(e))
    finally:
        runner.chain.restore(kept)
    return time.perf_counter() - t0

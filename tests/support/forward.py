"""One forward step of the paged model outside a server: a step's inputs laid out by hand, run
through a KV pool.
"""

from __future__ import annotations

import numpy as np
import torch

from protos.codec import PlanArrays, decode_plan, encode_plan
from worker.model.attention_native import make_backend
from worker.model.llama import StepInputs

BLOCK = 4  # run_step's blocks
STEP_BLOCK = 16  # step_inputs' blocks (the fused decode step's tests)


def run_step(model, config, pool, seqs, backend="torch", lora=None, state_slots=None):
    """seqs: list of (new_tokens, start_position, block_ids) -> (logits of each seq's last token,
    hidden); lora: (adapters, each sequence's index into them or -1) -> the rows' LoRA updates
    (model/lora.py); state_slots: a hybrid's slot for each sequence (those starting at 0 zeroed).
    """
    attn = make_backend(backend, torch.device("cpu"))
    tokens, positions, slots, lens, qsl = [], [], [], [], [0]
    width = max(len(b) for _, _, b in seqs)
    tables = torch.full((len(seqs), width), -1, dtype=torch.int32)
    for i, (new, start, blocks) in enumerate(seqs):
        pos = list(range(start, start + len(new)))
        tokens += new
        positions += pos
        slots += [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in pos]
        lens.append(start + len(new))
        qsl.append(qsl[-1] + len(new))
        tables[i, : len(blocks)] = torch.tensor(blocks)
    dev = pool.k[0].device  # the pool's device (CUDA in the CUDA-only tests)
    meta = attn.prepare(
        tables.to(dev),
        torch.tensor(lens, dtype=torch.int32, device=dev),
        torch.tensor(qsl, dtype=torch.int32, device=dev),
        BLOCK,
        max(lens),
        max(len(new) for new, _, _ in seqs),
    )
    step = StepInputs(
        torch.tensor(tokens, device=dev),
        torch.tensor(positions, device=dev),
        torch.tensor(slots, device=dev),
        meta,
    )
    if state_slots is not None:
        from worker.model.delta_net import StateStep

        step.state = StateStep(torch.tensor(state_slots, device=dev), qsl)
        fresh = [x for x, (_, at, _) in zip(state_slots, seqs, strict=True) if at == 0]
        pool.states.reset(torch.tensor(fresh, dtype=torch.int64))
    if lora is not None:
        from worker.model.lora import StepLora

        adapters, index = lora
        step.lora = StepLora.of(
            adapters,
            torch.repeat_interleave(
                torch.tensor(index), torch.tensor([len(new) for new, _, _ in seqs])
            ).to(dev),
        )
    with torch.no_grad():
        hidden = model(step, pool, attn)
        last = torch.tensor(qsl[1:], device=dev) - 1
        return model.compute_logits(hidden[last]), hidden


def step_inputs(seqs: list[tuple[int, int]], seed: int = 0):
    """StepInputs for (new tokens, sequence length) per sequence, blocks laid out one sequence after
    another, and the number of blocks used.
    """
    need = [-(-n // STEP_BLOCK) for _, n in seqs]
    tables = np.full((len(seqs), max(need)), -1, dtype="<i4")
    start = 0
    for i, n in enumerate(need):
        # blocks anywhere in the pool, not in order
        tables[i, :n] = np.arange(start, start + n)[::-1]
        start += n
    q_lens = np.array([q for q, _ in seqs])
    rows = np.repeat(np.arange(len(seqs)), q_lens)
    pos = np.concatenate([np.arange(n - q, n) for q, n in seqs])
    slots = tables[rows, pos // STEP_BLOCK].astype("<i8") * STEP_BLOCK + pos % STEP_BLOCK
    qsl = np.zeros(len(seqs) + 1, dtype="<i4")
    np.cumsum(q_lens, out=qsl[1:])
    k = len(seqs)
    rng = np.random.default_rng(seed)
    p = decode_plan(
        encode_plan(
            PlanArrays(
                step_id=1,
                token_ids=rng.integers(3, 200, len(pos)).astype("<i4"),
                positions=pos.astype("<i4"),
                slot_mapping=slots,
                block_tables=tables,
                seq_lens=np.array([n for _, n in seqs], dtype="<i4"),
                query_start_loc=qsl,
                do_sample=np.ones(k, bool),
                sample_index=np.zeros(k, "<i4"),
                temperature=np.zeros(k, "<f4"),
                top_p=np.ones(k, "<f4"),
                top_k=np.zeros(k, "<i4"),
                seed=np.zeros(k, "<u8"),
                block_copies=np.empty((0, 2), "<i4"),
            )
        )
    )
    return p, start

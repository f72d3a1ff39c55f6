"""Step execution: a StepPlan in, one batched forward and one sampler call, a StepResult out.

The plan is checked before anything touches the pool: a malformed or out-of-range plan is
rejected with an error result, never a crash and never a write outside the pool.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import structlog
import torch

from protos import wire_pb2
from protos.codec import CodecError, PlanArrays, decode_plan, encode_plan, encode_result
from worker.attention import AttentionBackend
from worker.controls import apply_controls, gather_controls, top_logprobs
from worker.kv_pool import KVPool
from worker.model import LlamaModel, StepInputs
from worker.sampler import NonFiniteLogits, SamplingBatch, check_sampled, sample_async

log = structlog.get_logger("worker.runner")


class PlanError(ValueError):
    """The plan is malformed or out of range; the worker answers with an error result."""


class StepDependencyError(RuntimeError):
    """A step took its input tokens from a step that failed after it was launched."""


@dataclass
class InFlight:
    """A launched step: its tokens are being copied to `host_tokens`; `clock` knows when that is done."""

    step_id: int
    do_sample: np.ndarray  # bool [S]
    host_tokens: torch.Tensor  # int64 [S], pinned on CUDA; -1 where a row does not sample
    clock: StepClock
    logprobs: object
    prompt_logprobs: object
    depends_on: int  # the step whose tokens it read on the device, 0 if none
    time_prepare: float
    host_forward: float
    host_sample: float


def validate_plan(p: PlanArrays, num_blocks: int, block_size: int, vocab: int, max_pos: int,
                  kv_window: int = 0) -> None:
    """Raise PlanError unless every array fits the pool, the vocabulary and the context. kv_window > 0 (every
    layer slides): a table needs blocks from the first one holding a key its queries' windows reach (the
    scheduler gives back those before; their entries are -1).

    num_blocks is the count the scheduler acknowledged, not this rank's own pool: every rank of a
    group then accepts or rejects the same plan alike, so none waits in a collective for the others."""
    s, t = p.num_seqs, p.num_tokens
    if s == 0 or t == 0:
        raise PlanError("a plan needs at least one sequence and one token")
    qsl = p.query_start_loc.astype(np.int64)
    q_lens = np.diff(qsl)
    if qsl[0] != 0 or qsl[-1] != t or (q_lens < 1).any():
        raise PlanError("query_start_loc must rise from 0 to num_tokens, at least one token per sequence")
    mb = p.block_tables.shape[1]
    if (p.seq_lens < q_lens).any() or (p.seq_lens > mb * block_size).any():
        raise PlanError("seq_lens must cover this step's tokens and fit the block tables")
    if ((p.token_ids < 0) | (p.token_ids >= vocab)).any():
        raise PlanError(f"token id outside the vocabulary [0, {vocab})")
    if ((p.positions < 0) | (p.positions >= max_pos)).any():
        raise PlanError(f"position outside [0, {max_pos})")
    if ((p.slot_mapping < -1) | (p.slot_mapping >= num_blocks * block_size)).any():
        raise PlanError(f"slot outside the pool of {num_blocks * block_size} slots")
    if ((p.block_tables < -1) | (p.block_tables >= num_blocks)).any():
        raise PlanError(f"block id outside the pool of {num_blocks} blocks")
    needed = (p.seq_lens.astype(np.int64) + block_size - 1) // block_size
    used = np.arange(mb)[None, :] < needed[:, None]
    if kv_window > 0:  # keys before (first query's position) - kv_window are never read
        first = np.maximum(p.seq_lens.astype(np.int64) - q_lens - kv_window, 0) // block_size
        used &= np.arange(mb)[None, :] >= first[:, None]
    if (p.block_tables[used] < 0).any():
        raise PlanError("a block table has no block for part of its sequence")
    if ((p.block_copies < 0) | (p.block_copies >= num_blocks)).any():
        raise PlanError("block copy outside the pool")
    if not np.isfinite(p.temperature).all() or (p.temperature < 0).any():
        raise PlanError("temperature must be finite and >= 0")
    if not ((p.top_p > 0) & (p.top_p <= 1)).all():
        raise PlanError("top_p must lie in (0, 1]")
    validate_controls(p, q_lens, vocab)


MAX_PLAN_LOGPROBS = 20


def check_mask(bitmask: np.ndarray, p: PlanArrays, vocab: int) -> np.ndarray:
    """The masks that followed a plan must cover its constrained rows and the vocabulary."""
    need = int(p.mask_rows.max()) + 1 if p.mask_rows is not None and p.mask_rows.size else 0
    if bitmask.shape[0] < need or bitmask.shape[1] * 32 < vocab:
        raise PlanError(f"the step's masks are {bitmask.shape[0]} x {bitmask.shape[1]} words; it needs {need} x "
                        f"{(vocab + 31) // 32}")
    return bitmask


def validate_controls(p: PlanArrays, q_lens: np.ndarray, vocab: int) -> None:
    """The request-control arrays of a plan (protos/wire.proto) must be consistent and in range."""
    if p.repetition_penalty is not None:
        if p.presence_penalty is None or p.frequency_penalty is None:
            raise PlanError("repetition_penalty, presence_penalty and frequency_penalty travel together")
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            if not np.isfinite(getattr(p, name)).all():
                raise PlanError(f"{name} must be finite")
        if (p.repetition_penalty <= 0).any():
            raise PlanError("repetition_penalty must be > 0")
    if p.min_p is not None and not ((p.min_p >= 0) & (p.min_p <= 1)).all():
        raise PlanError("min_p must lie in [0, 1]")
    if p.bias_offsets is not None:
        off = p.bias_offsets
        n = 0 if p.bias_token_ids is None else p.bias_token_ids.shape[0]
        if off[0] != 0 or (np.diff(off) < 0).any() or off[-1] != n or p.bias_values is None \
                or p.bias_values.shape[0] != n:
            raise PlanError("bias_offsets must rise from 0 to the number of bias entries")
        if n and (((p.bias_token_ids < 0) | (p.bias_token_ids >= vocab)).any() or np.isnan(p.bias_values).any()
                  or (p.bias_values == np.inf).any()):
            raise PlanError(f"a bias token outside the vocabulary [0, {vocab}) or a bias that is NaN or +inf")
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(p, name)
        if k is not None and ((k < -1) | (k > MAX_PLAN_LOGPROBS)).any():
            raise PlanError(f"{name} must lie in [-1, {MAX_PLAN_LOGPROBS}]")
    if p.prompt_logprobs is not None:
        counts, targets = p.prompt_logprob_counts, p.prompt_logprob_targets
        if counts is None or targets is None or (counts < 0).any() or (counts > q_lens).any() \
                or ((counts > 0) & (p.prompt_logprobs < 0)).any() or targets.shape[0] != int(counts.sum()):
            raise PlanError("prompt_logprob_counts must lie within each row's new tokens and match the targets")
        if ((targets < 0) | (targets >= vocab)).any():
            raise PlanError(f"a prompt logprob target outside the vocabulary [0, {vocab})")
    if p.mask_follows and (p.mask_rows is None or p.token_bitmask is not None):
        raise PlanError("a plan whose masks follow it carries mask_rows and no token_bitmask")
    if p.mask_rows is not None and not p.mask_follows:
        masks = 0 if p.token_bitmask is None else p.token_bitmask.shape[0]
        if ((p.mask_rows < -1) | (p.mask_rows >= masks)).any():
            raise PlanError("mask_rows refers to a bitmask the plan does not carry")
        if masks and p.token_bitmask.shape[1] * 32 < vocab:
            raise PlanError(f"token_bitmask rows have {p.token_bitmask.shape[1]} words; {vocab} tokens need "
                            f"{(vocab + 31) // 32}")


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: KVPool, attn: AttentionBackend, device: torch.device) -> None:
        self.model = model
        self.pool = pool
        # Blocks plans may address: the pool's size until the scheduler acknowledges its own count.
        self.num_blocks = pool.num_blocks
        self.attn = attn
        self.device = device
        self.config = model.config
        self.staging = Staging(device)
        self.graphs = None  # worker/graphs.py DecodeGraphs, set once captured (CUDA, unless --enforce-eager)
        # The tokens sampled by the last step launched, on the device: the next plan may refer to them
        # (overlap), before they are read back. Which of its rows sampled is known on the host.
        self.last_step_id = 0
        self._last_tokens: torch.Tensor | None = None
        self._last_sampled_rows: np.ndarray | None = None
        self._failed_steps: list[int] = []  # recent steps whose tokens must not be used
        self._token_buffers: list[torch.Tensor | None] = [None, None]
        self._flip = 0

    @torch.inference_mode()
    def execute(self, plan: wire_pb2.StepPlan, await_mask=None) -> wire_pb2.StepResult:
        """Run one step to its result (launch, then finish). await_mask(step_id) -> int32 [masks, words]: for a
        plan sent with mask_follows, blocks until the scheduler sends that step's masks."""
        launched = self.launch(plan, await_mask)
        return launched if isinstance(launched, wire_pb2.StepResult) else self.finish(launched)

    @torch.inference_mode()
    def launch(self, plan: wire_pb2.StepPlan, await_mask=None) -> InFlight | wire_pb2.StepResult:
        """Queue a step's whole work on the device — forward, logits, controls, sampling, and the copy of
        its tokens to pinned host memory — and return without waiting for it (a rejected plan: its error
        result). Tokens the plan takes from the previous step (prev_rows) are read on the device from that
        step's sampled tokens, so the worker can launch step N+1 before it reads step N back; `finish`
        then waits for this step's own work only."""
        t0 = time.perf_counter()
        try:
            p = decode_plan(plan)
            pending = self._pending_rows(p)
            validate_plan(p, self.num_blocks, self.pool.block_size, self.config.vocab_size,
                          self.config.max_position_embeddings, self.config.max_window)
            if p.mask_follows and await_mask is None:
                raise PlanError("the plan's masks follow it, and this worker has no socket to wait on them")
        except (CodecError, PlanError) as e:
            self._forget_tokens()  # a plan that refers to this one's tokens must not run either
            return wire_pb2.StepResult(step_id=plan.step_id, error=f"rejected plan: {e}")
        q_lens = np.diff(p.query_start_loc)
        rows = np.flatnonzero(p.do_sample)
        # every host array of the step in one transfer, the logits' row index included (before the forward)
        arrays = [(p.block_tables, torch.int32), (p.seq_lens, torch.int32), (p.query_start_loc, torch.int32),
                  (p.token_ids, torch.int64), (p.positions, torch.int64), (p.slot_mapping, torch.int64),
                  (p.block_copies, torch.int64), ((p.query_start_loc[1:].astype(np.int64) - 1)[rows], torch.int64)]
        if pending:
            arrays.append((p.prev_rows, torch.int64))
        staged = self.staging.put(arrays)
        block_tables, seq_lens, qsl, token_ids, positions, slot_mapping, copies, last_rows = staged[:8]
        if pending:  # tokens the step in flight (or done) sampled, read where they are
            prev = staged[8]
            token_ids = torch.where(prev >= 0, self._last_tokens[prev.clamp(min=0)].clamp(min=0), token_ids)
        graphed = self.graphs is not None and self.graphs.covers(q_lens, p.seq_lens)
        if not graphed:
            step = StepInputs(
                token_ids=token_ids, positions=positions, slot_mapping=slot_mapping,
                attn_meta=self.attn.prepare(block_tables, seq_lens, qsl, self.pool.block_size,
                                            max_seq_len=int(p.seq_lens.max()), max_q_len=int(q_lens.max()),
                                            host_q_lens=q_lens),
            )
        self.pool.copy_blocks(copies)
        self.pool.record_tokens(slot_mapping, token_ids)
        clock = StepClock(self.device)
        t1 = time.perf_counter()
        clock.mark("start")
        if graphed:  # a decode step replays its bucket's graph: forward and LM head of every row
            all_logits = self.graphs.run(token_ids, positions, slot_mapping, block_tables, seq_lens,
                                         int(p.seq_lens.max()))
        else:
            hidden = self.model(step, self.pool, self.attn)  # [num_tokens, hidden]
        t2 = time.perf_counter()
        logprobs = prompt_logprobs = None
        if p.prompt_logprobs is not None:  # every rank computes them too: compute_logits is a collective
            prompt_logprobs = self._prompt_logprobs(p, all_logits if graphed else None, None if graphed else hidden)
        tokens = torch.full((p.num_seqs,), -1, dtype=torch.int64, device=self.device)
        if rows.size:  # every rank of a group sees the same plan, so all of them take this branch or none
            raw = all_logits[last_rows] if graphed else self.model.compute_logits(hidden[last_rows])
            clock.mark("logits")
            t2 = time.perf_counter()
            if p.mask_follows:  # the forward is queued (or done): now the masks the scheduler computed meanwhile
                t_mask = time.perf_counter()
                p.token_bitmask = check_mask(await_mask(plan.step_id), p, self.config.vocab_size)
                t2 += time.perf_counter() - t_mask  # waiting is neither forward nor sampling
            controls = gather_controls(p, rows, block_tables, self.device)
            logits = apply_controls(raw, controls, self.pool)
            batch = SamplingBatch(
                temperature=torch.from_numpy(p.temperature[rows].copy()),
                top_p=torch.from_numpy(p.top_p[rows].copy()),
                top_k=torch.from_numpy(p.top_k[rows].astype(np.int64)),
                seeds=[int(x) for x in p.seed[rows]],
                sample_index=p.sample_index[rows].tolist(),
                min_p=torch.from_numpy(p.min_p[rows].copy()) if p.min_p is not None else None,
            )
            sampled = sample_async(logits, batch)
            tokens[torch.from_numpy(rows).to(self.device, non_blocking=True)] = sampled
            if p.logprobs is not None:
                ks = p.logprobs[rows]
                at = np.flatnonzero(ks >= 0)
                if at.size:
                    index = torch.from_numpy(at).to(raw.device)
                    logprobs = top_logprobs(raw[index], sampled[index].clamp(min=0), ks[at].astype(np.int64))
        else:
            clock.mark("logits")
        host = self._host_tokens(p.num_seqs)
        host.copy_(tokens, non_blocking=True)
        clock.mark("end")  # finish waits for this, not for what is queued after it
        t3 = time.perf_counter()
        self._last_tokens, self._last_sampled_rows, self.last_step_id = tokens, p.do_sample.copy(), plan.step_id
        return InFlight(plan.step_id, p.do_sample.copy(), host, clock, logprobs, prompt_logprobs,
                        depends_on=p.prev_step_id if pending else 0, time_prepare=t1 - t0,
                        host_forward=t2 - t1, host_sample=t3 - t2)

    def finish(self, f: InFlight) -> wire_pb2.StepResult:
        """Wait for a launched step's tokens and answer with its result. A step that read its input tokens
        from one that failed reports that instead of its own (garbage) tokens."""
        t = time.perf_counter()
        f.clock.wait()
        sampled = f.host_tokens.numpy().astype(np.int32)
        try:
            if f.depends_on and f.depends_on in self._failed_steps:
                raise StepDependencyError(f"step {f.step_id} took its tokens from step {f.depends_on}, which failed")
            check_sampled(sampled[f.do_sample])
        except (NonFiniteLogits, StepDependencyError):
            self._failed_steps.append(f.step_id)
            del self._failed_steps[:-8]
            if self.last_step_id == f.step_id:
                self._forget_tokens()
            raise
        waited = time.perf_counter() - t
        forward, sampling = f.clock.split(f.host_forward, f.host_sample + waited)
        return encode_result(f.step_id, sampled, logprobs=f.logprobs, prompt_logprobs=f.prompt_logprobs,
                             time_prepare=f.time_prepare, time_forward=forward, time_sample=sampling)

    # --- the previous step's tokens, on the device ------------------------------------------------
    @property
    def last_sampled(self) -> np.ndarray | None:
        """The last launched step's tokens on the host (-1 where a row did not sample); waits for it."""
        if self._last_tokens is None:
            return None
        return self._last_tokens.cpu().numpy().astype(np.int32)

    def _forget_tokens(self) -> None:
        self._last_tokens = self._last_sampled_rows = None

    def stream_state(self) -> tuple:
        """What links a step to the one before it (its id, tokens and sampled rows), to put back with
        restore_stream_state after steps that are not the scheduler's (the warm-up's)."""
        return self.last_step_id, self._last_tokens, self._last_sampled_rows

    def restore_stream_state(self, state: tuple) -> None:
        self.last_step_id, self._last_tokens, self._last_sampled_rows = state

    def _pending_rows(self, p: PlanArrays) -> bool:
        """Whether the plan takes tokens from the previous step (prev_rows), checked against which rows of
        that step sample — known on the host without waiting for their values. Their places in
        p.token_ids hold 0 until the device fills them."""
        if p.prev_rows is None or not (p.prev_rows >= 0).any():
            return False
        if self._last_sampled_rows is None or p.prev_step_id != self.last_step_id \
                or p.prev_step_id in self._failed_steps:
            raise CodecError(f"the plan needs tokens sampled in step {p.prev_step_id}, which this worker does not have "
                             f"(its last completed step is {self.last_step_id})")
        src = p.prev_rows[p.prev_rows >= 0]
        if (src >= self._last_sampled_rows.shape[0]).any() or not self._last_sampled_rows[src].all():
            raise CodecError(f"the plan refers to rows of step {p.prev_step_id} that sampled no token")
        p.token_ids = np.where(p.prev_rows >= 0, 0, p.token_ids).astype(np.int32)
        return True

    def _host_tokens(self, n: int) -> torch.Tensor:
        """Pinned host memory for a step's tokens; two buffers in turn, so the step in flight keeps its own
        while the next one is launched."""
        self._flip ^= 1
        buf = self._token_buffers[self._flip]
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 256), dtype=torch.int64, pin_memory=self.device.type == "cuda")
            self._token_buffers[self._flip] = buf
        return buf[:n]

    def _prompt_logprobs(self, p: PlanArrays, all_logits, hidden):
        """Log-probabilities of the prompt tokens after each row's first `count` new tokens (the plan's
        targets), from the logits at those positions."""
        counts = p.prompt_logprob_counts.astype(np.int64)
        at = np.flatnonzero(counts > 0)
        if at.size == 0:
            return None
        starts = p.query_start_loc[at].astype(np.int64)
        index = np.repeat(starts - np.concatenate([[0], np.cumsum(counts[at])[:-1]]), counts[at]) \
            + np.arange(int(counts[at].sum()))
        where = torch.from_numpy(index).to(self.device)
        logits = all_logits[where] if all_logits is not None else self.model.compute_logits(hidden[where])
        ks = np.repeat(p.prompt_logprobs[at].astype(np.int64), counts[at])
        return top_logprobs(logits, torch.from_numpy(p.prompt_logprob_targets.astype(np.int64)), ks)


_NUMPY = {torch.int32: np.int32, torch.int64: np.int64, torch.float32: np.float32}


class Staging:
    """A step's host arrays on the device. On CUDA they are packed into a pinned buffer and moved in one
    non-blocking transfer, then cut into typed views, instead of one pageable, synchronous copy each. Two
    buffers are used in turn, each with an event recorded after its transfer: the worker launches a step
    before the one before it is done, so the buffer written now is the one of two steps ago, whose transfer
    has run (the event says so; waiting on it is a formality). Every array starts at a multiple of ALIGN
    bytes. On a CPU each array is used as a tensor as it is (copied once, off the read-only wire buffer);
    `pack` forces the packed path there (for tests)."""

    ALIGN = 16  # every view starts 16-byte aligned, whatever the arrays before it

    def __init__(self, device: torch.device, pack: bool | None = None) -> None:
        self.device = device
        self.pack = device.type == "cuda" if pack is None else pack
        self._hosts: list[torch.Tensor | None] = [None, None]
        self._moved: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def put(self, arrays: list[tuple[np.ndarray, torch.dtype]]) -> list[torch.Tensor]:
        typed = [np.ascontiguousarray(a, dtype=_NUMPY[dtype]) for a, dtype in arrays]
        if not self.pack:
            return [torch.from_numpy(a if a.flags.writeable else a.copy()) for a in typed]
        offsets, total = [], 0
        for a in typed:
            offsets.append(total)
            total += -(-a.nbytes // self.ALIGN) * self.ALIGN
        self._turn ^= 1
        turn, cuda = self._turn, self.device.type == "cuda"
        if self._moved[turn] is not None:
            self._moved[turn].synchronize()  # this buffer's last transfer (two steps ago) has run
        buf = self._hosts[turn]
        if buf is None or buf.numel() < total:
            size = max(total, 2 * (0 if buf is None else buf.numel()), 1 << 16)
            buf = self._hosts[turn] = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
        host = buf.numpy()
        for a, at in zip(typed, offsets, strict=True):
            host[at : at + a.nbytes] = a.reshape(-1).view(np.uint8)
        moved = buf[:total].to(self.device, non_blocking=True)
        if cuda:
            self._moved[turn] = torch.cuda.Event()
            self._moved[turn].record()
        return [moved[at : at + a.nbytes].view(dtype).view(a.shape)
                for a, at, (_, dtype) in zip(typed, offsets, arrays, strict=True)]


def is_device_fatal(error: BaseException) -> bool:
    """A CUDA error (illegal address, device-side assert, ...) leaves the context unusable: every later
    call fails too. torch raises torch.AcceleratorError (2.8+) or a RuntimeError naming CUDA."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    text = str(error)
    return "CUDA error" in text or "device-side assert" in text or "CUBLAS_STATUS" in text


def warm_up(runner: ModelRunner) -> float:
    """Run three small steps through the whole path before serving — prompt chunks only, a mixed step,
    decodes only (each kind has its own kernels), greedy and sampled rows — so kernels compile, libraries
    pick their algorithms and the allocator warms now rather than on the first requests. It writes K/V into
    the pool's first blocks only (the scheduler owns no content there yet) and leaves the runner as it found
    it. Returns seconds taken."""
    bs = runner.pool.block_size
    per_seq = -(-5 // bs)  # blocks for 5 positions
    if runner.pool.num_blocks < 2 * per_seq:
        return 0.0
    tables = np.arange(2 * per_seq, dtype=np.int32).reshape(2, per_seq)
    # (sequence, first position, new tokens) of each row, per step
    steps = [[(0, 0, 3), (1, 0, 2)], [(0, 3, 1), (1, 2, 2)], [(0, 4, 1), (1, 4, 1)]]
    kept = runner.stream_state()
    t0 = time.perf_counter()
    try:  # a model whose logits are not finite (a broken checkpoint) fails here as it would on every step:
        # the steps report it to the scheduler; the warm-up only says so in the log
        for rows in steps:
            positions = np.concatenate([np.arange(a, a + n) for _, a, n in rows]).astype(np.int32)
            owner = np.repeat([r for r, _, _ in rows], [n for _, _, n in rows])
            plan = PlanArrays(
                step_id=(1 << 63) - 1, token_ids=(positions + 1).astype(np.int32), positions=positions,
                slot_mapping=tables[owner, positions // bs].astype(np.int64) * bs + positions % bs,
                block_tables=tables, seq_lens=np.array([a + n for _, a, n in rows], dtype=np.int32),
                query_start_loc=np.cumsum([0] + [n for _, _, n in rows]).astype(np.int32),
                do_sample=np.ones(2, dtype=bool), sample_index=np.zeros(2, dtype=np.int32),
                temperature=np.array([0.0, 1.0], dtype=np.float32), top_p=np.array([1.0, 0.9], dtype=np.float32),
                top_k=np.array([0, 5], dtype=np.int32), seed=np.zeros(2, dtype=np.uint64),
                block_copies=np.zeros((0, 2), dtype=np.int32))
            result = runner.execute(encode_plan(plan))
            if result.error:
                log.warning("warm_up_step_failed", error=result.error)
                break
    except Exception as e:  # noqa: BLE001 - any failure but a device's own is left to the steps to report
        if is_device_fatal(e):
            raise
        log.warning("warm_up_step_failed", error=repr(e))
    finally:
        runner.restore_stream_state(kept)
    return time.perf_counter() - t0


class StepClock:
    """Forward and sampling times of a step. On CUDA the host returns from the forward as soon as its kernels
    are queued, so host clocks would show GPU time as sampling: events recorded on the stream between the
    phases give the device's own times. The "end" event, recorded after the copy of the step's tokens to the
    host, is what `wait` blocks on: work queued after it (the next step) is not waited for. On a CPU the host
    clocks are the truth and this records nothing."""

    def __init__(self, device: torch.device) -> None:
        self.events: dict[str, torch.cuda.Event] | None = {} if device.type == "cuda" else None

    def mark(self, name: str) -> None:
        if self.events is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events[name] = event

    def wait(self) -> None:
        if self.events:
            self.events["end"].synchronize()

    def done(self) -> bool:
        """Whether the step's tokens are on the host (always, on a CPU)."""
        return not self.events or self.events["end"].query()

    def split(self, host_forward: float, host_sample: float) -> tuple[float, float]:
        """(forward, sampling) seconds; call after wait()."""
        if not self.events:
            return host_forward, host_sample
        e = self.events
        forward = e["start"].elapsed_time(e["logits"]) / 1000
        return forward, e["logits"].elapsed_time(e["end"]) / 1000

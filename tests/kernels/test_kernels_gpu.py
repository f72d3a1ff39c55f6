"""The Triton kernels natively on a GPU, at the shapes real models serve (`make test-kernels` on a
CUDA machine; skipped elsewhere, where tests/kernels/test_kernels.py runs them in the interpreter on
small shapes).

Llama-3-8B (32 query heads, 8 KV heads, head_dim 128), a 28/4 x 128 and a 14/2 x 64 model; bf16;
pages of 16 tokens scattered through a pool whose unused pages hold NaN; decode batches of 1 to 256
sequences of ragged lengths up to 8k; a 4k prompt, a 1k chunk over a 3k prefix, and mixed steps.
Then the whole step: every kernel compiled once across steps of every kind, none spilling.
"""

import numpy as np
import pytest
import torch

from kernels import reference

pytestmark = [
    pytest.mark.kernels,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="native kernels need a CUDA GPU"),
]

SHAPES = [(32, 8, 128), (28, 4, 128), (14, 2, 64)]
BLOCK = 16


def paged(q_lens, seq_lens, n_heads, n_kv, head_dim, seed, dtype=torch.bfloat16):
    """A pool holding exactly these sequences' keys on scattered pages, NaN everywhere else (and in
    every table entry past a sequence's pages).
    """
    g = torch.Generator(device="cuda").manual_seed(seed)
    pages = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(pages) + 2
    k = torch.full((num_blocks, BLOCK, n_kv, head_dim), float("nan"), dtype=dtype, device="cuda")
    v = torch.full_like(k, float("nan"))
    # block 0 never used
    order = torch.randperm(num_blocks - 1, generator=g, device="cuda").to(torch.int32) + 1
    # 0: a NaN page
    tables = torch.zeros(len(seq_lens), max(pages) + 1, dtype=torch.int32, device="cuda")
    at = 0
    for i, n in enumerate(pages):
        ids = order[at : at + n]
        at += n
        tables[i, :n] = ids
        k[ids] = torch.randn(n, BLOCK, n_kv, head_dim, generator=g, device="cuda").to(dtype)
        v[ids] = torch.randn(n, BLOCK, n_kv, head_dim, generator=g, device="cuda").to(dtype)
    # the tail of each sequence's last page lies past its length: poison it again
    for i, s in enumerate(seq_lens):
        if s % BLOCK:
            k[tables[i, pages[i] - 1], s % BLOCK :] = float("nan")
            v[tables[i, pages[i] - 1], s % BLOCK :] = float("nan")
    q = torch.randn(sum(q_lens), n_heads, head_dim, generator=g, device="cuda").to(dtype)
    qsl = torch.tensor(np.cumsum([0] + list(q_lens)), dtype=torch.int32, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return q, k, v, tables, lens, qsl, head_dim**-0.5


def rel_error(out, ref):
    assert torch.isfinite(out).all(), "NaN or inf reached the output"
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}kv{}d{}".format(*s))
@pytest.mark.parametrize("batch", [1, 8, 64, 256])
def test_decode_at_real_shapes_and_ragged_lengths(shape, batch):
    from kernels.triton_attention import paged_attention

    rng = np.random.default_rng(batch)
    for context in (512, 2048, 8192):
        if batch == 256 and context == 8192 and shape[2] == 128:
            context = 4096  # 256 sequences of 8k at d128 would hold 17 GB of keys and values
        lens = rng.integers(context // 2, context + 1, batch).tolist()
        lens[0] = context  # the longest one always there
        args = paged([1] * batch, lens, *shape, seed=batch * 7 + context)
        out = paged_attention(*args, max_seq_len=context, max_q_len=1)
        err = rel_error(out, reference.paged_attention(*args))
        assert err < 1e-2, (batch, context, err)
        del args, out


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}kv{}d{}".format(*s))
def test_prefill_a_4k_prompt_and_a_1k_chunk_over_a_3k_prefix(shape):
    from kernels.triton_attention import paged_attention

    for q_lens, seq_lens in (([4096], [4096]), ([1024], [4024])):
        args = paged(q_lens, seq_lens, *shape, seed=sum(seq_lens))
        out = paged_attention(*args, max_seq_len=max(seq_lens), max_q_len=max(q_lens))
        assert rel_error(out, reference.paged_attention(*args)) < 1e-2


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}kv{}d{}".format(*s))
def test_mixed_steps_of_decodes_chunks_and_fresh_prompts(shape):
    """Chunked prefill puts prompt chunks beside running decodes; the backend sends each to its
    kernel.
    """
    from worker.model.attention_native import make_backend

    q_lens = [1] * 40 + [512, 1, 97, 1, 1000]
    seq_lens = [int(x) for x in np.random.default_rng(3).integers(1, 6000, 40)] + [
        512,
        7000,
        2097,
        33,
        1000,
    ]
    q, k, v, tables, lens, qsl, scale = paged(q_lens, seq_lens, *shape, seed=11)
    backend = make_backend("triton", torch.device("cuda"))
    meta = backend.prepare(
        tables, lens, qsl, BLOCK, max(seq_lens), max(q_lens), host_q_lens=np.array(q_lens)
    )
    assert meta.mixed is not None
    out = backend.forward(q, k, v, meta, scale)
    assert rel_error(out, reference.paged_attention(q, k, v, tables, lens, qsl, scale)) < 1e-2


def test_every_kernel_is_compiled_once_across_steps_of_every_kind_and_none_spills(tmp_path):
    """A worker's steps change their shapes, lengths and (from the staging buffer) the offsets of
    their small arrays; none of that may compile a kernel again (a stall of seconds while serving).
    Warm-up, graph capture, prompts, chunks beside decodes, decode batches in and out of the graphs:
    one version per kernel (two of the residual-add + norm, with and without the residual), and no
    spilled registers.
    """
    import json

    from kernels.compile_report import _jit_functions, runtime_report
    from protos.codec import PlanArrays, encode_plan
    from worker.model.attention_native import make_backend
    from worker.model.kv_pool import KVPool
    from worker.step.graphs import DecodeGraphs
    from worker.step.runner import ModelRunner
    from worker.step.warm_up import warm_up
    from worker.weights.loader import load_model

    for fn in _jit_functions().values():
        fn.device_caches.clear()  # count what this test compiles
    cfg = dict(
        model_type="llama",
        vocab_size=32000,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    device = torch.device("cuda")
    model, config = load_model(str(tmp_path), "dummy", torch.bfloat16, device)
    pool = KVPool(config, 4096, BLOCK, torch.bfloat16, device)
    for t in pool.k + pool.v:  # the decode rows' earlier keys were never written by a prefill here
        t.normal_()
    runner = ModelRunner(model, pool, make_backend(None, device), device)
    warm_up(runner)
    runner.graphs = DecodeGraphs(model, pool, runner.attn, device, max_rows=32, max_context=2048)
    runner.graphs.capture_all()
    rng = np.random.default_rng(0)
    free = list(range(1, 4096))
    step_id = 0

    def run(q_lens, seq_lens, temperature=0.0, top_p=1.0):
        nonlocal step_id
        step_id += 1
        pages = [-(-s // BLOCK) for s in seq_lens]
        tables = np.full((len(seq_lens), max(pages)), -1, dtype=np.int32)
        for i, n in enumerate(pages):
            tables[i, :n] = free[:n]
            free.extend(free[:n])
            del free[:n]
        positions = np.concatenate(
            [np.arange(s - q, s) for q, s in zip(q_lens, seq_lens, strict=True)]
        )
        owner = np.repeat(np.arange(len(q_lens)), q_lens)
        slots = tables[owner, positions // BLOCK].astype(np.int64) * BLOCK + positions % BLOCK
        s = len(q_lens)
        plan = PlanArrays(
            step_id=step_id,
            token_ids=rng.integers(0, 32000, len(positions)).astype(np.int32),
            positions=positions.astype(np.int32),
            slot_mapping=slots,
            block_tables=tables,
            seq_lens=np.array(seq_lens, dtype=np.int32),
            query_start_loc=np.cumsum([0] + q_lens).astype(np.int32),
            do_sample=np.ones(s, dtype=bool),
            sample_index=np.zeros(s, dtype=np.int32),
            temperature=np.full(s, temperature, dtype=np.float32),
            top_p=np.full(s, top_p, dtype=np.float32),
            top_k=np.zeros(s, dtype=np.int32),
            seed=np.arange(s, dtype=np.uint64),
            block_copies=np.zeros((0, 2), dtype=np.int32),
        )
        result = runner.execute(encode_plan(plan))
        assert not result.error, result.error

    for n in (5, 17, 100, 333, 1024):  # prompts
        run([n], [n])
    for rows in (1, 3, 7, 19, 32, 45, 80):  # decodes, in the graphs and past them
        lens = rng.integers(2, 3000, rows).tolist()
        run([1] * rows, lens, temperature=0.7, top_p=0.9)
    for extra in (1, 2, 5):  # chunks beside decodes, of odd sizes
        q = [1] * (extra * 3) + [37 * extra, 211]
        run(q, [int(x) + q_ for x, q_ in zip(rng.integers(1, 2000, len(q)), q, strict=True)])
    report = runtime_report()
    twice = {"_add_rms_norm_kernel"}
    for name, versions in report.items():
        assert len(versions) <= (2 if name in twice else 1), (name, versions)
        assert all(v["spills"] == 0 for v in versions), (name, versions)
    assert {
        "decode_split_kernel",
        "prefill_kernel",
        "write_kv_kernel",
        "_top_p_floor_kernel",
    } <= set(report)

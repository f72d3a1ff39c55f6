"""Our paged Llama forward against transformers' own, on tiny random models made here."""

import pytest
import torch

from tests.support.forward import BLOCK, run_step
from tests.support.tiny import make_tiny_llama
from worker.model.attention_native import make_backend
from worker.model.kv_pool import KVPool
from worker.weights.loader import load_model

ATOL = 2e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = make_tiny_llama(tmp_path_factory.mktemp("tiny"), seed=3)
    from transformers import LlamaForCausalLM

    ours, config = load_model(str(folder), "auto", torch.float32, torch.device("cpu"))
    return ours, config, LlamaForCausalLM.from_pretrained(str(folder)).eval(), folder


@pytest.fixture(scope="module")
def tiny_packed(tiny):
    """The same weights with the projections on oneDNN, each weight packed once and the loaded
    copies dropped: what the CPU worker runs where oneDNN is the faster library.
    """
    from worker.model.linear import OneDNNMatmul

    _, _, hf, folder = tiny
    model, config = load_model(str(folder), "auto", torch.float32, torch.device("cpu"))
    model.use_matmul(OneDNNMatmul())
    assert model.layers[0].qkv.numel() == 0  # the forward reads only the packed copies
    return model, config, hf, folder


def model_for(request, packed: bool):
    return request.getfixturevalue("tiny_packed" if packed else "tiny")


def test_prefill_logits_match_transformers(tiny):
    model, config, hf, _ = tiny
    pool = KVPool(config, 32, BLOCK, torch.float32, torch.device("cpu"))
    prompt = torch.randint(
        0, config.vocab_size, (13,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    blocks = [31, 0, 17, 5]  # scattered, out of order, first and last block of the pool included
    _, hidden = run_step(model, config, pool, [(prompt, 0, blocks)])
    ours = model.compute_logits(hidden)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize(
    "backend,packed", [("torch", False), ("triton", False), ("cpu", True), ("cpu", False)]
)
def test_token_by_token_decode_through_the_paged_pool_matches(request, backend, packed):
    """Two interleaved sequences decode token by token in one batch, blocks scattered and
    interleaved. The triton backend runs its kernels (under TRITON_INTERPRET=1 without a GPU); the
    cpu backend its native decode kernel, with the projections on packed oneDNN weights or F.linear.
    """
    model, config, hf, _ = model_for(request, packed)
    pool = KVPool(config, 32, BLOCK, torch.float32, torch.device("cpu"))
    pool.k[0].fill_(float("nan"))  # stale bytes anywhere but the written slots must not matter
    pool.v[1].fill_(float("nan"))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=g).tolist() for n in (6, 3)]
    blocks = [[9, 2, 30, 14, 7, 22], [1, 27, 11, 31, 20, 0]]
    # Prefill of sequence 0 and 1 together (a mixed-length batch).
    logits, _ = run_step(
        model, config, pool, [(prompts[0], 0, blocks[0]), (prompts[1], 0, blocks[1])], backend
    )
    seqs = [list(p) for p in prompts]
    for _ in range(6 if backend == "triton" else 14):
        nxt = logits.argmax(-1).tolist()
        starts = [len(s) for s in seqs]
        for s, t in zip(seqs, nxt, strict=True):
            s.append(t)
        logits, _ = run_step(
            model, config, pool, [([seqs[i][-1]], starts[i], blocks[i]) for i in range(2)], backend
        )
        with torch.no_grad():
            for i in range(2):
                ref = hf(torch.tensor([seqs[i]])).logits[0, -1]
                torch.testing.assert_close(logits[i], ref, atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("backend,packed", [("torch", False), ("triton", False), ("cpu", True)])
def test_mixed_prefill_and_decode_rows_in_one_step(request, backend, packed):
    model, config, hf, _ = model_for(request, packed)
    pool = KVPool(config, 16, BLOCK, torch.float32, torch.device("cpu"))
    a = [5, 9, 11, 40, 2, 8, 100]
    b = [7, 3, 3, 250, 61]
    run_step(model, config, pool, [(a[:6], 0, [3, 8])], backend)
    # a decodes its 7th token while b prefills from scratch, in the same forward
    logits, _ = run_step(model, config, pool, [([a[6]], 6, [3, 8]), (b, 0, [12, 4])], backend)
    with torch.no_grad():
        torch.testing.assert_close(
            logits[0], hf(torch.tensor([a])).logits[0, -1], atol=ATOL, rtol=1e-4
        )
        torch.testing.assert_close(
            logits[1], hf(torch.tensor([b])).logits[0, -1], atol=ATOL, rtol=1e-4
        )


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "tied"])
def test_other_llama_family_variants(tmp_path, family):
    """Qwen2 (QKV bias), Qwen3 (per-head q/k norm) and tied embeddings load and match too."""
    import transformers

    torch.manual_seed(0)
    common = dict(
        vocab_size=200,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=128,
    )
    if family == "qwen2":
        hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif family == "qwen3":
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **common))
    else:
        hf = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(tie_word_embeddings=True, **common)
        )
    with torch.no_grad():  # random biases, so that a dropped bias would show
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    hf.eval().save_pretrained(str(tmp_path))
    model, config = load_model(str(tmp_path), "auto", torch.float32, torch.device("cpu"))
    pool = KVPool(config, 8, BLOCK, torch.float32, torch.device("cpu"))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    _, hidden = run_step(model, config, pool, [(prompt, 0, [6, 1, 3])])
    with torch.no_grad():
        torch.testing.assert_close(
            model.compute_logits(hidden), hf(torch.tensor([prompt])).logits[0], atol=ATOL, rtol=1e-4
        )


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_a_step_pools_its_rows_hidden_states_as_asked_through_chunks(tmp_path, backend):
    """StepPlan.pooling: a row gives back its last token's final hidden state, the sum over its
    tokens (a prompt in two chunks: the sums add up to the whole prompt's), or its first token's,
    beside a row that samples; what transformers' Qwen3Model says at those positions.
    """
    import numpy as np
    import transformers

    from protos.codec import POOL_FIRST, POOL_LAST, POOL_SUM, PlanArrays, encode_plan
    from protos.result_codec import decode_pooled
    from worker.step.runner import ModelRunner

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=200,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    transformers.Qwen3Model(cfg).eval().save_pretrained(str(tmp_path))
    hf = transformers.Qwen3Model.from_pretrained(str(tmp_path)).eval()
    model, config = load_model(str(tmp_path), "auto", torch.float32, torch.device("cpu"))
    runner = ModelRunner(
        model,
        KVPool(config, 32, BLOCK, torch.float32, torch.device("cpu")),
        make_backend(backend, torch.device("cpu")),
        torch.device("cpu"),
    )
    prompts = [
        [5, 17, 3, 9, 40, 2, 11],
        [8, 1, 60, 61, 62, 7, 30, 31, 4, 12, 99],
        [4, 4, 9],
        [3, 1, 4, 1],
    ]
    with torch.no_grad():
        ref = [hf(torch.tensor([q])).last_hidden_state[0] for q in prompts]

    def step(step_id, rows, pooling):
        """rows: (prompt index, first token, last token) each, its blocks 4 * index on."""
        tokens, pos, slots, qsl = [], [], [], [0]
        for i, a, b in rows:
            tokens += prompts[i][a:b]
            pos += list(range(a, b))
            slots += [(4 * i + t // BLOCK) * BLOCK + t % BLOCK for t in range(a, b)]
            qsl.append(qsl[-1] + b - a)
        k = len(rows)
        plan = encode_plan(
            PlanArrays(
                step_id=step_id,
                token_ids=np.array(tokens, np.int32),
                positions=np.array(pos, np.int32),
                slot_mapping=np.array(slots, np.int64),
                block_tables=np.array(
                    [[4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3] for i, _, _ in rows], np.int32
                ),
                seq_lens=np.array([b for _, _, b in rows], np.int32),
                query_start_loc=np.array(qsl, np.int32),
                do_sample=np.array([p == 0 for p in pooling]),
                sample_index=np.zeros(k, np.int32),
                temperature=np.zeros(k, np.float32),
                top_p=np.ones(k, np.float32),
                top_k=np.zeros(k, np.int32),
                seed=np.zeros(k, np.uint64),
                block_copies=np.zeros((0, 2), np.int32),
                pooling=np.array(pooling, np.int32),
            )
        )
        result = runner.execute(plan)
        assert not result.error
        return decode_pooled(result, sum(p > 0 for p in pooling), config.hidden_size)

    tol = dict(atol=1e-4, rtol=1e-4)
    first = step(
        1, [(0, 0, 7), (1, 0, 5), (2, 0, 3), (3, 0, 4)], [POOL_LAST, POOL_SUM, POOL_FIRST, 0]
    )
    torch.testing.assert_close(torch.tensor(first[0]), ref[0][-1], **tol)
    torch.testing.assert_close(torch.tensor(first[2]), ref[2][0], **tol)
    second = step(2, [(1, 5, 11)], [POOL_SUM])  # the rest of prompt 1, over its first chunk's K/V
    torch.testing.assert_close(torch.tensor(first[1] + second[0]), ref[1].sum(0), **tol)
    assert runner.execute(
        encode_plan(
            PlanArrays(
                step_id=3,
                token_ids=np.array([1], np.int32),
                positions=np.array([0], np.int32),
                slot_mapping=np.array([0], np.int64),
                block_tables=np.array([[0]], np.int32),
                seq_lens=np.array([1], np.int32),
                query_start_loc=np.array([0, 1], np.int32),
                do_sample=np.array([False]),
                sample_index=np.zeros(1, np.int32),
                temperature=np.zeros(1, np.float32),
                top_p=np.ones(1, np.float32),
                top_k=np.zeros(1, np.int32),
                seed=np.zeros(1, np.uint64),
                block_copies=np.zeros((0, 2), np.int32),
                pooling=np.array([5], np.int32),
            )
        )
    ).error.startswith("rejected plan: pooling must be")


def test_a_bare_decoder_checkpoint_loads_and_its_hidden_states_match_transformers(tmp_path):
    """Embedding models ship the decoder without its head (Qwen3-Embedding: a `Qwen3Model`, tensors
    named `layers.0...`, no `model.` before them): it loads, and the final hidden states are
    transformers'.
    """
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=200,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    hf = transformers.Qwen3Model(cfg).eval()
    hf.save_pretrained(str(tmp_path))
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert "embed_tokens.weight" in f.keys() and not any(
            k.startswith("model.") for k in f.keys()
        )
    model, config = load_model(str(tmp_path), "auto", torch.float32, torch.device("cpu"))
    pool = KVPool(config, 8, BLOCK, torch.float32, torch.device("cpu"))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    _, hidden = run_step(model, config, pool, [(prompt, 0, [6, 1, 3])])
    with torch.no_grad():
        torch.testing.assert_close(
            hidden, hf(torch.tensor([prompt])).last_hidden_state[0], atol=ATOL, rtol=1e-4
        )


def test_checkpoint_missing_a_weight_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = make_tiny_llama(tmp_path, seed=0, num_hidden_layers=1)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.0.mlp.down_proj.weight"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(KeyError, match="down_proj"):
        load_model(str(folder), "auto", torch.float32, torch.device("cpu"))


def test_dummy_weights_have_the_real_shapes_and_run(tmp_path):
    folder = make_tiny_llama(tmp_path, seed=0, num_hidden_layers=2)
    real, config = load_model(str(folder), "auto", torch.float32, torch.device("cpu"))
    dummy, dummy_config = load_model(
        str(folder), "dummy", torch.float32, torch.device("cpu"), seed=1
    )
    assert dummy_config == config
    for (name, a), (_, b) in zip(real.named_parameters(), dummy.named_parameters(), strict=True):
        assert a.shape == b.shape, name
    assert not torch.equal(real.layers[0].qkv, dummy.layers[0].qkv)
    pool = KVPool(config, 8, BLOCK, torch.float32, torch.device("cpu"))
    logits, _ = run_step(dummy, config, pool, [([1, 2, 3, 4, 5], 0, [2, 5])])
    assert torch.isfinite(logits).all()


def test_gpu_pool_sizing_arithmetic():
    from worker.serve.sizing import blocks_for_gpu_budget

    gib = 2**30
    # 80 GiB card at 0.9: 72 GiB, minus 16 GiB of weights and activations, minus 1 GiB used by
    # others
    assert blocks_for_gpu_budget(80 * gib, 0.9, 16 * gib, 1 * gib, 2 * 2**20) == (
        72 * gib - 17 * gib
    ) // (2 * 2**20)
    # the weights alone exceed the share
    assert blocks_for_gpu_budget(8 * gib, 0.5, 5 * gib, 0, 2**20) == 0
    with pytest.raises(ValueError):
        blocks_for_gpu_budget(8 * gib, 1.5, 0, 0, 1)


def test_kv_memory_budget_parsing():
    from protos.base.argtypes import parse_bytes

    assert parse_bytes("2GiB") == 2 * 2**30 and parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5GB") == 1_500_000_000 and parse_bytes("1000") == 1000
    with pytest.raises(ValueError, match="size"):
        parse_bytes("lots")


def _one_seq_plan(step_id, tokens, start, prev=None, seed=7):
    import numpy as np

    from protos.codec import PlanArrays, encode_plan

    pos = np.arange(start, start + len(tokens), dtype=np.int32)
    return encode_plan(
        PlanArrays(
            step_id=step_id,
            token_ids=np.asarray(tokens, dtype=np.int32),
            positions=pos,
            slot_mapping=(10 * BLOCK + pos).astype(np.int64),
            block_tables=np.array([[10, 11, 12]], dtype=np.int32),
            seq_lens=np.array([start + len(tokens)], dtype=np.int32),
            query_start_loc=np.array([0, len(tokens)], dtype=np.int32),
            do_sample=np.array([True]),
            sample_index=np.array([start], dtype=np.int32),
            temperature=np.array([0.8], dtype=np.float32),
            top_p=np.full(1, 0.9, dtype=np.float32),
            top_k=np.zeros(1, dtype=np.int32),
            seed=np.array([seed], dtype=np.uint64),
            block_copies=np.zeros((0, 2), dtype=np.int32),
            prev_step_id=prev or 0,
            prev_rows=None if prev is None else np.array([0], dtype=np.int32),
        )
    )


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_warm_up_leaves_the_runner_as_it_found_it(tiny, backend):
    """The start-up warm-up step runs the whole path (mixed prefill and decode, greedy and sampled)
    and changes nothing a plan can observe: the next plan, and one that refers to the previous
    step's tokens, give what they give on a runner that was never warmed.
    """
    from worker.step.runner import ModelRunner
    from worker.step.warm_up import warm_up

    model, config, _, _ = tiny
    plan = _one_seq_plan

    answers = []
    for warm in (False, True):
        pool = KVPool(config, 16, BLOCK, torch.float32, torch.device("cpu"))
        runner = ModelRunner(
            model, pool, make_backend(backend, torch.device("cpu")), torch.device("cpu")
        )
        first = runner.execute(plan(5, [3, 4, 5, 6, 7], 0))
        if warm:
            assert warm_up(runner) > 0
        second = runner.execute(plan(6, [0], 5, prev=5))  # its input is the token step 5 sampled
        assert not first.error and not second.error
        answers.append((first.sampled_token_ids, second.sampled_token_ids))
    assert answers[0] == answers[1]


def test_a_step_launched_before_the_last_one_is_read_back_takes_its_tokens_on_the_device(tiny):
    """The worker launches step N+1 (its input token read from step N's sampled tokens on the
    device) before it reads step N back: the tokens are those of running the steps one after the
    other. A step whose source step fails once read back fails too, and so does a later plan that
    refers to it.
    """
    from worker.step.runner import ModelRunner, StepDependencyError
    from worker.step.sampler import NonFiniteLogits

    model, config, _, _ = tiny

    def runner():
        pool = KVPool(config, 16, BLOCK, torch.float32, torch.device("cpu"))
        return ModelRunner(
            model, pool, make_backend("torch", torch.device("cpu")), torch.device("cpu")
        )

    one_by_one = runner()
    want = [
        one_by_one.execute(_one_seq_plan(5, [3, 4, 5, 6, 7], 0)),
        one_by_one.execute(_one_seq_plan(6, [0], 5, prev=5)),
        one_by_one.execute(_one_seq_plan(7, [0], 6, prev=6)),
    ]
    piped = runner()
    f5 = piped.launch(_one_seq_plan(5, [3, 4, 5, 6, 7], 0))
    f6 = piped.launch(_one_seq_plan(6, [0], 5, prev=5))
    r5 = piped.land(f5)
    f7 = piped.launch(_one_seq_plan(7, [0], 6, prev=6))
    got = [r5, piped.land(f6), piped.land(f7)]
    assert [r.sampled_token_ids for r in got] == [r.sampled_token_ids for r in want]
    assert not any(r.error for r in got)

    broken = runner()
    f5 = broken.launch(_one_seq_plan(5, [3, 4, 5, 6, 7], 0))
    f6 = broken.launch(_one_seq_plan(6, [0], 5, prev=5))
    with torch.inference_mode():
        f5.host_tokens.fill_(-1)  # as if its row had no finite logits
    with pytest.raises(NonFiniteLogits):
        broken.land(f5)
    with pytest.raises(StepDependencyError, match="step 5"):
        broken.land(f6)
    rejected = broken.execute(_one_seq_plan(7, [0], 6, prev=6))
    assert "rejected plan" in rejected.error and "step 6" in rejected.error


def test_staging_packs_a_steps_arrays_into_one_transfer_and_cuts_them_back():
    """The packed path (a pinned buffer and one transfer on CUDA; forced here on the CPU) gives back
    every array with its values, dtype and shape, empty ones and odd byte counts included, each
    16-byte aligned, and reuses and grows its two buffers across steps without touching the previous
    step's.
    """
    import numpy as np

    from worker.step.staging import Staging

    staging = Staging(torch.device("cpu"), pack=True)
    rng = np.random.default_rng(0)
    before, previous = [], []
    for step in range(3):
        arrays = [
            (rng.integers(-5, 100, (3 + step, 7)).astype(np.int32), torch.int32),
            (rng.integers(0, 1 << 40, 5 + 1000 * step), torch.int64),
            (np.zeros((0, 2), dtype=np.int32), torch.int64),
            (rng.integers(0, 9, 3).astype(np.int16), torch.int32),  # converted on the way
            (rng.random(11).astype(np.float32), torch.float32),
        ]
        out = staging.put(arrays)
        for (a, dtype), t in zip(arrays, out, strict=True):
            assert t.dtype == dtype and tuple(t.shape) == a.shape
            assert np.array_equal(t.numpy(), a.astype(t.numpy().dtype))
            # 16-byte aligned whatever came before: a kernel argument's alignment never changes step
            # to step
            assert t.data_ptr() % 16 == 0
        # the step before is still on the device: intact
        for (a, _), t in zip(before, previous, strict=True):
            assert np.array_equal(t.numpy(), a.astype(t.numpy().dtype))
        before, previous = arrays, out
    assert max(h.numel() for h in staging._hosts) >= 8 * 2005


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_decode_graph_fitting_gives_the_eager_steps_tokens(tiny, backend):
    """Decode steps through DecodeGraphs' static buffers (padded to a bucket, tables padded to the
    captured width; on CUDA a graph replay, here the same forward eagerly) sample exactly what the
    plain path does, step after step, as the batch shrinks between buckets and the sequences grow
    from the short context tier into the long one; a prompt chunk or a longer sequence runs eagerly.
    """
    import numpy as np

    from protos.codec import PlanArrays, encode_plan
    from worker.step.graphs import DecodeGraphs
    from worker.step.runner import ModelRunner

    model, config, _, _ = tiny
    cpu = torch.device("cpu")

    def plan(step_id, seqs):
        """seqs: (tokens, start, blocks) per sequence, as in run_step."""
        tokens = [t for new, _, _ in seqs for t in new]
        pos = np.concatenate([np.arange(a, a + len(new)) for new, a, _ in seqs]).astype(np.int32)
        owner = np.repeat(np.arange(len(seqs)), [len(new) for new, _, _ in seqs])
        width = max(len(b) for _, _, b in seqs)
        tables = np.full((len(seqs), width), -1, dtype=np.int32)
        for i, (_, _, b) in enumerate(seqs):
            tables[i, : len(b)] = b
        n = len(seqs)
        return encode_plan(
            PlanArrays(
                step_id=step_id,
                token_ids=np.asarray(tokens, dtype=np.int32),
                positions=pos,
                slot_mapping=tables[owner, pos // BLOCK].astype(np.int64) * BLOCK + pos % BLOCK,
                block_tables=tables,
                seq_lens=np.array([a + len(new) for new, a, _ in seqs], dtype=np.int32),
                query_start_loc=np.cumsum([0] + [len(new) for new, _, _ in seqs]).astype(np.int32),
                do_sample=np.ones(n, dtype=bool),
                sample_index=np.arange(n, dtype=np.int32),
                temperature=np.where(np.arange(n) % 2, 0.7, 0.0).astype(np.float32),
                top_p=np.ones(n, dtype=np.float32),
                top_k=np.zeros(n, dtype=np.int32),
                seed=np.arange(n, dtype=np.uint64) + 3,
                block_copies=np.zeros((0, 2), dtype=np.int32),
            )
        )

    def serve(with_graphs):
        pool = KVPool(config, 40, BLOCK, torch.float32, cpu)
        runner = ModelRunner(model, pool, make_backend(backend, cpu), cpu)
        if with_graphs:
            # two tiers: sequences up to 12 keys replay the short one, up to 24 the long one
            runner.graphs = DecodeGraphs(
                model, pool, runner.attn, cpu, max_rows=8, max_context=[24, 12]
            )
            runner.graphs.capture_all()
            assert runner.graphs.buckets == [1, 2, 4, 8] and runner.graphs.contexts == [12, 24]
            assert sorted(runner.graphs.graphs) == [(c, b) for c in (12, 24) for b in (1, 2, 4, 8)]
            assert [runner.graphs.tier(n) for n in (1, 12, 13, 24)] == [12, 12, 24, 24]
        # scattered, 28 keys each
        blocks = [[(7 * i + 3 * j) % 35 for j in range(7)] for i in range(5)]
        prompts = [[5 + i, 9, 11 + i] for i in range(5)]
        rows = [(p, 0, b) for p, b in zip(prompts, blocks, strict=True)]
        out = [runner.execute(plan(1, rows)).sampled_token_ids]
        live, length, step = list(range(5)), 3, 2
        last = dict(zip(live, np.frombuffer(out[-1], dtype=np.int32).tolist(), strict=True))
        while live:
            if with_graphs:
                assert runner.graphs.covers(np.ones(len(live)), np.full(len(live), length + 1)) == (
                    length < 24
                )
            res = runner.execute(plan(step, [([last[i]], length, blocks[i]) for i in live]))
            assert not res.error
            out.append(res.sampled_token_ids)
            last = dict(
                zip(
                    live, np.frombuffer(res.sampled_token_ids, dtype=np.int32).tolist(), strict=True
                )
            )
            length, step = length + 1, step + 1
            if length in (7, 12, 15):  # rows leave: 5 -> 4 -> 3 -> 2 (buckets 8, 4, 4, 2)
                live = live[:-1]
            if length >= 26:  # past max_context: eager again
                live = []
        return out

    assert serve(True) == serve(False)


def test_decode_graph_replay_on_cuda_matches_the_eager_forward(tiny):
    """Natively on CUDA: a captured bucket replayed for a smaller batch gives the eager forward's
    logits.
    """
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from worker.step.graphs import DecodeGraphs

    _, _, _, folder = tiny
    cuda = torch.device("cuda")
    model, config = load_model(str(folder), "auto", torch.float32, cuda)
    pool = KVPool(config, 32, BLOCK, torch.float32, cuda)
    attn = make_backend("triton", cuda)
    # some K/V
    run_step(model, config, pool, [([5, 6, 7, 8, 9], 0, [1, 2]), ([3, 4], 0, [3])], "triton")
    graphs = DecodeGraphs(model, pool, attn, cuda, max_rows=4, max_context=16)
    graphs.capture_all()
    tables = torch.tensor([[1, 2], [3, -1]], dtype=torch.int32, device=cuda)
    got = graphs.run(
        torch.tensor([10, 11], device=cuda),
        torch.tensor([5, 2], device=cuda),
        torch.tensor([2 * BLOCK + 1, 3 * BLOCK + 2], device=cuda),
        tables,  # positions 5 and 2
        torch.tensor([6, 3], dtype=torch.int32, device=cuda),
        6,
    )
    pool2 = KVPool(config, 32, BLOCK, torch.float32, cuda)
    run_step(model, config, pool2, [([5, 6, 7, 8, 9], 0, [1, 2]), ([3, 4], 0, [3])], "triton")
    want, _ = run_step(model, config, pool2, [([10], 5, [1, 2]), ([11], 2, [3])], "triton")
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)

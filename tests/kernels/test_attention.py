"""The worker's CPU attention backends (torch, and cpu with its native decode and prefill kernels)
against the plain reference, on adversarial paged inputs.
"""

import pytest
import torch

from kernels.reference import paged_attention, write_kv
from tests.support.paged_case import make_case
from worker.model.attention_native import make_backend


@pytest.mark.parametrize("backend_name", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("n_heads,n_kv_heads", [(4, 4), (4, 2), (8, 2), (10, 2)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_backend_matches_reference_on_mixed_batches(backend_name, n_heads, n_kv_heads, block_size):
    """triton (in the interpreter here) splits the mixed step: decode rows through the split-KV
    kernels, prompt chunks through the prefill kernel.
    """
    # decode rows, a fresh prefill, a chunk over a cached prefix, lengths at block boundaries
    q_lens = [1, 7, 1, 5, 1, 3]
    seq_lens = [1, 7, block_size, block_size + 5, block_size + 1, 3 * block_size - 1]
    c = make_case(q_lens, seq_lens, n_heads, n_kv_heads, 16, block_size, seed=0)
    backend = make_backend(backend_name, torch.device("cpu"))
    assert backend.name == backend_name
    meta = backend.prepare(
        c.block_tables, c.seq_lens, c.query_start_loc, block_size, max(seq_lens), max(q_lens)
    )
    if backend_name == "triton":
        # gathered once for the step: each decoding sequence's query token, the chunks' starts and
        # ends
        qsl = c.query_start_loc.tolist()
        assert meta.mixed.decode_rows.tolist() == [qsl[0], qsl[2], qsl[4]]
        assert meta.mixed.prefill_starts.tolist() == [qsl[1], qsl[3], qsl[5]]
        assert meta.mixed.prefill_ends.tolist() == [qsl[2], qsl[4], qsl[6]]
    out = backend.forward(c.q, c.k_cache, c.v_cache, meta, c.scale)
    ref = paged_attention(*c.args)
    assert torch.isfinite(out).all() and torch.isfinite(ref).all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_reference_head_mapping_and_causality():
    """One KV head filled with a constant value: exactly its query heads read that constant."""
    block_size, n_heads, n_kv_heads = 4, 6, 3
    c = make_case([3], [6], n_heads, n_kv_heads, 8, block_size, seed=1)
    q, k, v, tables, lens, qsl = (
        c.q,
        c.k_cache,
        c.v_cache,
        c.block_tables,
        c.seq_lens,
        c.query_start_loc,
    )
    slots = (
        tables[0, torch.arange(6) // block_size].long() * block_size + torch.arange(6) % block_size
    )
    v.view(-1, n_kv_heads, 8)[slots, 1] = 7.0
    out = paged_attention(q, k, v, tables, lens, qsl, 0.3)
    assert torch.allclose(out[:, 2:4], torch.full_like(out[:, 2:4], 7.0))
    assert not torch.allclose(out[:, 0:2], torch.full_like(out[:, 0:2], 7.0))
    # the first query of a 3-token chunk over 6 keys sees keys 0..3 only: changing key 5 changes
    # nothing for it
    v2 = v.clone()
    v2.view(-1, n_kv_heads, 8)[slots[5]] += 100.0
    out2 = paged_attention(q, k, v2, tables, lens, qsl, 0.3)
    assert torch.equal(out[:2], out2[:2]) and not torch.equal(out[2], out2[2])


def test_write_kv_padding_slots_write_nothing():
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros(2, 4, 1, 2)
    before = k_cache.clone()
    write_kv(torch.ones(3, 1, 2), torch.ones(3, 1, 2), k_cache, v_cache, torch.tensor([-1, 5, -1]))
    changed = (k_cache != before).any(-1).any(-1).flatten().nonzero().flatten().tolist()
    assert changed == [5]


@pytest.mark.parametrize(
    "n_heads,n_kv_heads,head_dim",
    [(9, 3, 64), (32, 8, 128), (8, 1, 256), (6, 2, 80), (4, 4, 24), (48, 12, 256)],
)
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_native_decode_kernel_on_long_ragged_batches(n_heads, n_kv_heads, head_dim, block_size):
    """Every decode row at once: lengths from 1 to past 2k (partial last blocks, a block boundary
    exactly), GQA groups 1-8, head dims on (multiples of 16) and off the vector path, NaN everywhere
    unwritten; 48 heads of 256 are more state than one work item holds, so a sequence's KV heads are
    split over items (8 + 4).
    """
    from kernels import cpu_native

    native = cpu_native.load()
    seq_lens = [1, 2, block_size, block_size + 1, 3 * block_size - 1, 300, 2100]
    c = make_case([1] * len(seq_lens), seq_lens, n_heads, n_kv_heads, head_dim, block_size, seed=4)
    out = torch.full_like(c.q, float("nan"))
    native.paged_decode(
        c.q,
        c.k_cache,
        c.v_cache,
        out,
        torch.arange(len(seq_lens)),
        c.block_tables,
        c.seq_lens,
        c.scale,
    )
    torch.testing.assert_close(out, paged_attention(*c.args), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("seq_lens", [[150], [2100, 70], [64, 64, 65]])
@pytest.mark.parametrize("variant", ["plain", "window", "softcap-sinks", "bf16", "48 heads of 256"])
def test_few_long_sequences_attend_in_key_ranges_merged_as_one_softmax(seq_lens, variant):
    """With fewer sequences than work for the threads, each one's keys are cut into block-aligned
    ranges (all KV heads an item) whose softmax states are merged: the same answer as the reference,
    whole or through a window that leaves some ranges empty, with a soft cap and sinks, over a bf16
    pool, and with more heads than one item holds; and the same answer as one sequence at a time.
    """
    from kernels import cpu_native

    native = cpu_native.load()
    n_heads, n_kv_heads, head_dim = (48, 12, 256) if variant == "48 heads of 256" else (32, 8, 64)
    c = make_case([1] * len(seq_lens), seq_lens, n_heads, n_kv_heads, head_dim, 16, seed=6)
    k, v = c.k_cache, c.v_cache
    if variant == "bf16":
        k, v = k.bfloat16(), v.bfloat16()
    extra = {
        "window": dict(window=40),
        "softcap-sinks": dict(softcap=2.0, sinks=torch.linspace(-1.0, 2.0, n_heads)),
    }.get(variant, {})
    rows = torch.arange(len(seq_lens))

    def decode(which):
        out = torch.full_like(c.q, float("nan"))
        native.paged_decode(
            c.q, k, v, out, rows[which], c.block_tables[which], c.seq_lens[which], c.scale, **extra
        )  # fmt: skip
        return out

    got = decode(slice(None))
    want = paged_attention(c.q, k.float(), v.float(), *c.args[3:], **extra)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    for i in range(len(seq_lens)):  # alone, a sequence's keys are cut into more ranges
        torch.testing.assert_close(decode(slice(i, i + 1))[i], got[i], atol=2e-6, rtol=1e-5)


def test_native_decode_kernel_writes_only_its_rows_and_rejects_wrong_inputs():
    from kernels import cpu_native

    native = cpu_native.load()
    c = make_case([3, 1, 2, 1], [5, 9, 2, 17], 4, 2, 16, 4, seed=5)
    # the decode rows' query tokens: sequence 1 (token 3) and 3 (token 6)
    rows = torch.tensor([3, 6])
    out = torch.zeros_like(c.q)
    native.paged_decode(
        c.q,
        c.k_cache,
        c.v_cache,
        out,
        rows,
        c.block_tables[[1, 3]].contiguous(),
        c.seq_lens[[1, 3]].contiguous(),
        c.scale,
    )
    ref = paged_attention(*c.args)
    torch.testing.assert_close(out[rows], ref[rows], atol=1e-5, rtol=1e-5)
    others = [i for i in range(c.q.shape[0]) if i not in rows.tolist()]
    assert torch.equal(out[others], torch.zeros_like(out[others]))
    with pytest.raises(TypeError, match="float32"):
        native.paged_decode(
            c.q.double(), c.k_cache, c.v_cache, out, rows, c.block_tables, c.seq_lens, c.scale
        )
    with pytest.raises(ValueError, match="contiguous"):
        native.paged_decode(
            c.q.transpose(0, 1),
            c.k_cache,
            c.v_cache,
            out,
            rows,
            c.block_tables,
            c.seq_lens,
            c.scale,
        )


def test_cpu_backend_falls_back_to_torch_where_the_kernel_does_not_cover_the_shape():
    # group 64
    assert make_backend(None, torch.device("cpu"), (64, 1, 64, 16, torch.float32)).name == "torch"
    assert make_backend(None, torch.device("cpu"), (8, 2, 64, 16, torch.bfloat16)).name == "torch"
    assert make_backend(None, torch.device("cpu"), (8, 2, 64, 16, torch.float32)).name == "cpu"
    with pytest.raises(ValueError, match="does not cover"):
        make_backend("cpu", torch.device("cpu"), (64, 1, 64, 16, torch.float32))


@pytest.mark.parametrize(
    "n_heads,n_kv_heads,head_dim",
    [(9, 3, 64), (32, 8, 128), (8, 1, 256), (6, 2, 80), (4, 4, 24), (16, 1, 64)],
)
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_native_prefill_kernel_on_chunks_with_cached_prefixes(
    n_heads, n_kv_heads, head_dim, block_size
):
    """Prompt chunks of every shape in one step: whole prompts (q_len == seq_len), chunks over a
    cached prefix (q_len < seq_len), lengths around the 16-key and 16-query tiles and past them,
    among decode rows; the queries a strided view of a fused QKV row, as the model passes them; NaN
    everywhere unwritten; only the prefill rows are written.
    """
    from kernels import cpu_native

    native = cpu_native.load()
    q_lens = [2, 17, 16, 1, 40, 33, 5, 300]
    seq_lens = [2, 17, 31, 50, 40, 100, 260, 301]
    c = make_case(q_lens, seq_lens, n_heads, n_kv_heads, head_dim, block_size, seed=7)
    fused = torch.randn(c.q.shape[0], (n_heads + 2 * n_kv_heads) * head_dim)
    fused[:, : n_heads * head_dim] = c.q.flatten(1)
    q = fused[:, : n_heads * head_dim].view(c.q.shape)  # stride(0) past the heads, as in the model
    qsl = c.query_start_loc.long()
    pre = [i for i, n in enumerate(q_lens) if n > 1]
    out = torch.full_like(c.q, float("nan"))
    native.paged_prefill(
        q,
        c.k_cache,
        c.v_cache,
        out,
        qsl[pre].contiguous(),
        torch.tensor([q_lens[i] for i in pre], dtype=torch.int32),
        c.seq_lens[pre].contiguous(),
        c.block_tables[pre].contiguous(),
        c.scale,
    )
    expected = paged_attention(*c.args)
    for i in range(len(q_lens)):
        rows = slice(int(qsl[i]), int(qsl[i + 1]))
        if i in pre:
            torch.testing.assert_close(out[rows], expected[rows], atol=2e-5, rtol=1e-5)
        else:
            assert out[rows].isnan().all()  # a decode row: not the prefill kernel's to write


def test_cpu_backend_prefill_falls_back_to_torch_for_queries_it_cannot_read_in_place():
    # prefill rows only: q is passed as it comes
    c = make_case([30, 5, 12], [30, 40, 50], 8, 2, 32, 16, seed=3)
    backend = make_backend("cpu", torch.device("cpu"))
    meta = backend.prepare(c.block_tables, c.seq_lens, c.query_start_loc, 16, 50, 30)
    odd = c.q.transpose(1, 2).contiguous().transpose(1, 2)  # head_dim not the unit stride
    assert odd.stride(2) != 1
    torch.testing.assert_close(
        backend.forward(odd, c.k_cache, c.v_cache, meta, c.scale),
        paged_attention(*c.args),
        atol=2e-5,
        rtol=1e-5,
    )


def _brute_force(c, window: int, softcap: float = 0.0, sinks=None) -> torch.Tensor:
    """Each query's softmax over exactly the keys it may see (scores soft-capped where softcap > 0,
    a sink logit beside them where given), in float64, one query at a time.
    """
    n_heads = c.q.shape[1]
    block_size, n_kv = c.k_cache.shape[1], c.k_cache.shape[2]
    out = torch.zeros_like(c.q, dtype=torch.float64)
    qsl = c.query_start_loc.tolist()
    for i, seq_len in enumerate(c.seq_lens.tolist()):
        q_len = qsl[i + 1] - qsl[i]
        for r in range(q_len):
            pos = seq_len - q_len + r
            keys = [j for j in range(pos + 1) if window <= 0 or j > pos - window]
            blocks = c.block_tables[i, [j // block_size for j in keys]].long()
            within = torch.tensor([j % block_size for j in keys])
            k = c.k_cache[blocks, within].double()  # [keys, n_kv, head_dim]
            v = c.v_cache[blocks, within].double()
            for h in range(n_heads):
                kh = h // (n_heads // n_kv)
                scores = k[:, kh] @ c.q[qsl[i] + r, h].double() * c.scale
                if softcap > 0:
                    scores = softcap * torch.tanh(scores / softcap)
                if sinks is not None:
                    scores = torch.cat([scores, sinks[h : h + 1].double()])
                w = torch.softmax(scores, dim=0)[: len(keys)]
                out[qsl[i] + r, h] = w @ v[:, kh]
    return out.to(c.q.dtype)


def assert_backend_gives(backend_name, c, want, window, softcap=0.0, sinks=None) -> None:
    """The backend over the case's step (decodes and chunks together) equals `want`."""
    backend = make_backend(backend_name, torch.device("cpu"))
    q_lens = (c.query_start_loc[1:] - c.query_start_loc[:-1]).tolist()
    meta = backend.prepare(
        c.block_tables, c.seq_lens, c.query_start_loc, c.k_cache.shape[1],
        int(c.seq_lens.max()), max(q_lens),
    )  # fmt: skip
    out = backend.forward(c.q, c.k_cache, c.v_cache, meta, c.scale, window, softcap, sinks)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)


def _poison_out_of_window(c, window: int) -> None:
    """NaN into every key and value no query of its sequence may see: a kernel that read one would
    say so.
    """
    block_size = c.k_cache.shape[1]
    qsl = c.query_start_loc.tolist()
    for i, seq_len in enumerate(c.seq_lens.tolist()):
        first = seq_len - (qsl[i + 1] - qsl[i])  # the first query's position
        for j in range(max(first - window + 1, 0)):
            b, w = int(c.block_tables[i, j // block_size]), j % block_size
            c.k_cache[b, w] = float("nan")
            c.v_cache[b, w] = float("nan")


@pytest.mark.parametrize("backend_name", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("window", [1, 3, 16, 37, 500])
def test_a_sliding_window_shows_each_query_its_last_keys_only(backend_name, window):
    """Decodes and prompt chunks (one over a cached prefix, one longer than the prefill tiles) in a
    sliding-window layer: each query sees its last `window` keys, itself included, as brute force
    says; the reference agrees; the native and Triton kernels never read a key outside every window
    (poisoned).
    """
    block_size = 4
    q_lens = [1, 40, 1, 9, 1, 70]
    seq_lens = [1, 40, 23, 61, 100, 70]
    c = make_case(q_lens, seq_lens, 8, 2, 16, block_size, seed=11)
    want = _brute_force(c, window)
    torch.testing.assert_close(paged_attention(*c.args, window=window), want, atol=1e-5, rtol=1e-5)
    if window < 500:
        assert not torch.allclose(paged_attention(*c.args), want, atol=1e-3)  # the window mattered
    if backend_name != "torch":  # torch gathers every slot and masks them: finite values only
        _poison_out_of_window(c, window)
    backend = make_backend(backend_name, torch.device("cpu"))
    meta = backend.prepare(
        c.block_tables, c.seq_lens, c.query_start_loc, block_size, max(seq_lens), max(q_lens)
    )
    out = backend.forward(c.q, c.k_cache, c.v_cache, meta, c.scale, window)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend_name", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("window", [0, 5])
def test_soft_capped_scores_equal_brute_force(backend_name, window):
    """Gemma 2's attention-logit soft-capping (every scaled score s becomes cap * tanh(s / cap)),
    with and without a sliding window, over decodes and prompt chunks (one over a cached prefix):
    scores large enough that the cap changes the result.
    """
    block_size, cap = 4, 2.0
    q_lens = [1, 19, 1, 9, 33]
    seq_lens = [1, 19, 23, 30, 33]
    c = make_case(q_lens, seq_lens, 8, 2, 16, block_size, seed=12)
    c.q.mul_(4.0)  # scores of several units: tanh bends them
    want = _brute_force(c, window, softcap=cap)
    assert not torch.allclose(_brute_force(c, window), want, atol=1e-3)  # the cap mattered
    torch.testing.assert_close(
        paged_attention(*c.args, window=window, softcap=cap), want, atol=1e-5, rtol=1e-5
    )
    assert_backend_gives(backend_name, c, want, window, cap)


@pytest.mark.parametrize("backend_name", ["torch", "cpu", "triton"])
@pytest.mark.parametrize("window", [0, 5])
def test_attention_sinks_take_their_share_of_every_softmax(backend_name, window):
    """gpt-oss's sinks: one learned logit a query head beside the scores, whose probability is
    dropped, over decodes and prompt chunks (one over a cached prefix), with and without a window;
    sinks large and small enough that they change the answer.
    """
    block_size = 4
    q_lens = [1, 19, 1, 9, 33]
    seq_lens = [1, 19, 23, 30, 33]
    c = make_case(q_lens, seq_lens, 8, 2, 16, block_size, seed=13)
    sinks = torch.tensor([-3.0, 0.0, 1.0, 2.5, -0.5, 4.0, 0.3, -8.0])
    want = _brute_force(c, window, sinks=sinks)
    assert not torch.allclose(_brute_force(c, window), want, atol=1e-3)  # the sinks mattered
    torch.testing.assert_close(
        paged_attention(*c.args, window=window, sinks=sinks), want, atol=1e-5, rtol=1e-5
    )
    assert_backend_gives(backend_name, c, want, window, 0.0, sinks)


@pytest.mark.parametrize("bf16_dots", [False, True])
def test_native_prefill_applies_sinks_on_a_bf16_pool(bf16_dots):
    """The bf16 pool's prompt paths (vectors, bf16 dots, AMX tiles where present) end each row's
    softmax with the sink as the fp32 path does.
    """
    from kernels import cpu_native

    native = cpu_native.load()
    if native is None:
        pytest.skip("the native CPU kernels are not built here")
    c = make_case([33, 9], [33, 30], 8, 2, 64, 16, seed=14)
    sinks = torch.linspace(-2.0, 3.0, 8)
    k16, v16 = c.k_cache.bfloat16(), c.v_cache.bfloat16()
    starts = c.query_start_loc[:-1].to(torch.int64)
    q_lens = (c.query_start_loc[1:] - c.query_start_loc[:-1]).to(torch.int32)
    out = torch.zeros_like(c.q)
    native.paged_prefill(
        c.q, k16, v16, out, starts, q_lens, c.seq_lens, c.block_tables, c.scale,
        bf16_dots=bf16_dots, sinks=sinks,
    )  # fmt: skip
    want = paged_attention(c.q, k16.float(), v16.float(), *c.args[3:], sinks=sinks)
    torch.testing.assert_close(out, want, atol=3e-2 if bf16_dots else 1e-5, rtol=1e-2)


@pytest.mark.parametrize("backend_name", ["torch", "cpu", "triton"])
@pytest.mark.parametrize(
    "n_heads,n_kv_heads,head_dim,block_size",
    [(8, 2, 64, 16), (32, 8, 128, 32), (6, 2, 24, 4), (8, 1, 256, 1)],
)
@pytest.mark.parametrize("window", [0, 21])
def test_a_bf16_pool_is_read_as_its_values_widened(
    backend_name, n_heads, n_kv_heads, head_dim, block_size, window
):
    """--kv-cache-dtype bf16: decodes and prompt chunks (one over a cached prefix, one past the
    tiles) over a bf16 pool with fp32 queries give the reference's answer over the same pool widened
    to fp32 (head sizes on the vector paths and off them, one-token blocks, a sliding window), and
    differ from the fp32 pool's.
    """
    if backend_name == "triton" and head_dim == 256:
        pytest.skip(
            "the interpreter's 256-wide tiles take minutes; 64/128/24 cover the kernel's paths"
        )
    q_lens = [1, 19, 1, 9, 1, 40]
    seq_lens = [1, 19, 23, 61, 100, 70]
    c = make_case(q_lens, seq_lens, n_heads, n_kv_heads, head_dim, block_size, seed=21)
    k16, v16 = c.k_cache.to(torch.bfloat16), c.v_cache.to(torch.bfloat16)
    want = paged_attention(c.q, k16.float(), v16.float(), *c.args[3:], window=window)
    backend = make_backend(backend_name, torch.device("cpu"))
    meta = backend.prepare(
        c.block_tables, c.seq_lens, c.query_start_loc, block_size, max(seq_lens), max(q_lens)
    )
    out = backend.forward(c.q, k16, v16, meta, c.scale, window)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)
    assert not torch.allclose(out, paged_attention(*c.args, window=window), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "n_heads,n_kv_heads,head_dim,block_size",
    [(16, 8, 128, 16), (9, 3, 64, 1), (8, 1, 256, 32), (6, 2, 96, 16), (6, 2, 80, 16)],
)
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (21, 0.0), (0, 30.0)])
@pytest.mark.parametrize("tiles", [True, False], ids=["amx-tiles", "vectors"])
def test_bf16_dot_prefill_stays_within_bf16_rounding_of_the_exact_answer(
    n_heads, n_kv_heads, head_dim, block_size, window, softcap, tiles, request
):
    """bf16_dots (a model served in bf16): queries and softmax weights rounded to bf16, both
    products in bf16 dot products. Over the same bf16 pool it stays within bf16's rounding of the
    exact fp32 answer (chunks over cached prefixes, lengths around the 16-key and 16-query tiles, a
    sliding window, soft-capping), differs from the fp32 arithmetic where the CPU has the
    instructions, and is that arithmetic bit for bit where it does not apply: an fp32 pool, a head
    size not a multiple of 32 (80), a CPU without AVX512_BF16. Both kernels: on AMX tiles (where the
    CPU and the OS have them) and in vector registers.
    """
    from kernels import cpu_native

    native = cpu_native.load()
    native.prefill_tiles(tiles)
    request.addfinalizer(lambda: native.prefill_tiles(True))
    q_lens = [2, 17, 16, 40, 33, 5, 300]
    seq_lens = [2, 17, 31, 40, 100, 260, 301]
    c = make_case(q_lens, seq_lens, n_heads, n_kv_heads, head_dim, block_size, seed=5)
    k16, v16 = c.k_cache.to(torch.bfloat16), c.v_cache.to(torch.bfloat16)
    qsl = c.query_start_loc.long()
    args = (
        qsl[:-1].contiguous(),
        torch.tensor(q_lens, dtype=torch.int32),
        c.seq_lens,
        c.block_tables,
    )

    def run(k, v, bf16_dots):
        out = torch.full_like(c.q, float("nan"))
        native.paged_prefill(c.q, k, v, out, *args, c.scale, window, softcap, bf16_dots=bf16_dots)
        return out

    exact = run(k16, v16, False)
    want = paged_attention(
        c.q, k16.float(), v16.float(), *c.args[3:], window=window, softcap=softcap
    )
    torch.testing.assert_close(exact, want, atol=2e-5, rtol=1e-5)
    got = run(k16, v16, True)
    assert torch.isfinite(got).all()
    err = (got - want).abs()
    # |v| ~ 1: bf16's 2^-9 steps
    assert err.max() < 3e-2 and err.mean() < 3e-3, (
        err.max(),
        err.mean(),
    )
    # the tiles ran, not the vector kernel
    if tiles and native.prefill_tiles() and head_dim % 32 == 0:
        native.prefill_tiles(False)
        assert not torch.equal(run(k16, v16, True), got)
        native.prefill_tiles(True)
    if native.prefill_bf16_dots and head_dim % 32 == 0:
        assert not torch.equal(got, exact)
    else:
        assert torch.equal(got, exact)
    # fp32 pool
    assert torch.equal(run(c.k_cache, c.v_cache, True), run(c.k_cache, c.v_cache, False))


def test_write_kv_rounds_into_a_bf16_pool_as_torch_does():
    k = torch.randn(5, 2, 8)
    v = torch.randn(5, 2, 8)
    k_cache = torch.zeros(3, 4, 2, 8, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    write_kv(k, v, k_cache, v_cache, torch.tensor([0, 5, 6, -1, 11]))
    flat = k_cache.view(-1, 2, 8)
    assert torch.equal(flat[[0, 5, 6, 11]], k[[0, 1, 2, 4]].to(torch.bfloat16))
    assert torch.equal(v_cache.view(-1, 2, 8)[[0, 5, 6, 11]], v[[0, 1, 2, 4]].to(torch.bfloat16))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_the_native_kv_write_stores_the_fused_rows_views_as_the_reference_does(kv_dtype):
    """The CPU backend's write of a step's keys and values: k and v as views of the fused QKV rows
    (strided, as the layer hands them over), padding slots skipped, a bf16 pool rounded to nearest
    even, NaN and infinities kept: the reference's pool, value for value; tensors of another form go
    the reference's way.
    """
    from kernels import cpu_native

    native = cpu_native.load()
    if native is None:
        pytest.skip("native CPU kernels did not build here")
    heads, kv_heads, dim, tokens = 6, 2, 64, 300
    qkv = (
        torch.randn(
            tokens, (heads + 2 * kv_heads) * dim, generator=torch.Generator().manual_seed(1)
        )
        * 50
    )
    qkv[0, heads * dim : heads * dim + 3] = torch.tensor(
        [float("nan"), float("inf"), float("-inf")]
    )
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    slots = torch.randperm(40 * 16, generator=torch.Generator().manual_seed(2))[:tokens]
    slots[[3, 77, 299]] = -1
    want_k, want_v = (
        torch.zeros(40, 16, kv_heads, dim, dtype=kv_dtype),
        torch.zeros(40, 16, kv_heads, dim, dtype=kv_dtype),
    )
    write_kv(k, v, want_k, want_v, slots)
    backend = make_backend("cpu", torch.device("cpu"))
    got_k, got_v = torch.zeros_like(want_k), torch.zeros_like(want_v)
    backend.write_kv(k, v, got_k, got_v, slots)

    # every value equal, NaN where NaN (torch writes a bf16 NaN with other payload bits)
    def same(a, b):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)

    same(got_k, want_k)
    same(got_v, want_v)
    assert (
        got_k.isnan().sum() == 1 and got_k.isinf().sum() == 2 and (got_k != 0).sum() > tokens * 100
    )
    assert not native.write_kv(k.double(), v.double(), got_k, got_v, slots)
    odd_k, odd_v = torch.zeros_like(want_k), torch.zeros_like(want_v)
    # the reference's way: the same values
    backend.write_kv(k.double(), v.double(), odd_k, odd_v, slots)
    same(odd_k, want_k)
    same(odd_v, want_v)

"""LoRA in the worker's forward: adapters read from PEFT's own files, many in one step, each row's
logits equal to PEFT's model with that adapter (and the base rows to the base model's).
"""

import json

import pytest
import torch

from scheduler_service.core.adapters import BaseShapes, read_adapter
from tests.support.forward import BLOCK, run_step
from tests.support.lora import ALL, make_adapter, peft_model
from tests.support.tiny import make_tiny_llama
from worker.model.kv_pool import KVPool
from worker.model.parallel import make_shard
from worker.weights.loader import load_model
from worker.weights.lora import lora_bytes, read_lora


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    """family -> (base folder, {adapter name: folder}) for a tiny Llama and a tiny Qwen3."""
    out = {}
    for family in ("llama", "qwen3"):
        root = tmp_path_factory.mktemp(f"lora-{family}")
        base = make_tiny_llama(root / "base", seed=3, family=family)
        out[family] = (
            base,
            {
                "attn": make_adapter(
                    base, root / "attn", r=4, targets=["q_proj", "v_proj"], alpha=8, seed=1
                ),
                "all": make_adapter(
                    base, root / "all", r=8, targets=ALL, alpha=16, seed=2, use_rslora=True
                ),
                "mlp": make_adapter(
                    base,
                    root / "mlp",
                    r=2,
                    targets=["o_proj", "up_proj", "down_proj"],
                    alpha=4,
                    seed=3,
                ),
            },
        )
    return out


def _ours(base, adapters):
    model, config = load_model(str(base), "auto", torch.float32, torch.device("cpu"))
    shard = make_shard(
        config.num_heads, config.num_kv_heads, config.intermediate_size, config.vocab_size
    )
    shapes = BaseShapes.from_config(json.loads((base / "config.json").read_text()))
    weights = []
    for folder in adapters:
        identity = read_adapter("x", folder, shapes).identity
        weights.append(
            read_lora(folder, identity, config, shard, torch.float32, torch.device("cpu"), 16)
        )
    return model, config, weights


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_step_of_three_adapters_and_the_base_equals_peft_row_by_row(family_models, family):
    base, adapters = family_models[family]
    names = list(adapters)
    model, config, weights = _ours(base, [adapters[n] for n in names])
    pool = KVPool(config, 64, BLOCK, torch.float32, torch.device("cpu"))
    prompts = [
        [5, 9, 33, 7, 81, 4, 19],
        [12, 40, 7, 3, 99],
        [8, 8, 120, 66, 2, 17, 30, 41, 5],
        [50, 3, 6],
    ]
    which = [0, 1, -1, 2]  # attn, all, the base model, mlp
    seqs, next_block = [], 0
    for p in prompts:
        n = -(-len(p) // BLOCK)
        seqs.append((p, 0, list(range(next_block, next_block + n))))
        next_block += n
    logits, _ = run_step(model, config, pool, seqs, lora=(weights, which))
    for row, (p, w) in enumerate(zip(prompts, which, strict=True)):
        reference = peft_model(base, adapters[names[w]] if w >= 0 else None)
        with torch.no_grad():
            want = reference(input_ids=torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(logits[row], want, rtol=1e-4, atol=1e-4)
    # and the adapters change the answer: a row's base logits differ from its adapter's
    fresh = KVPool(config, 64, BLOCK, torch.float32, torch.device("cpu"))
    base_logits, _ = run_step(model, config, fresh, seqs)
    for row, w in enumerate(which):
        assert (w < 0) == torch.allclose(base_logits[row], logits[row], atol=1e-5)


def test_many_adapters_of_one_shape_batched_together_equal_peft(family_models, tmp_path):
    """Adapters that change the same projections at the same rank go through one batched update
    (their rows padded into one batch, their A and B stacked): each row still gets its own
    adapter's.
    """
    base, adapters = family_models["llama"]
    folders = [adapters["all"]] + [
        make_adapter(
            base, tmp_path / f"s{i}", r=8, targets=ALL, alpha=16, seed=10 + i, use_rslora=True
        )
        for i in range(3)
    ]
    model, config, weights = _ours(base, folders)
    prompts = [[5 + i, 9, 33 + 2 * i, 7, 81, 4 + i][: 3 + i % 4] for i in range(9)]
    which = [0, 1, 2, 3, -1, 3, 2, 1, 0]
    seqs, at = [], 0
    for p in prompts:
        n = -(-len(p) // BLOCK)
        seqs.append((p, 0, list(range(at, at + n))))
        at += n
    pool = KVPool(config, 64, BLOCK, torch.float32, torch.device("cpu"))
    step_logits, _ = run_step(model, config, pool, seqs, lora=(weights, which))
    for row, (p, w) in enumerate(zip(prompts, which, strict=True)):
        with torch.no_grad():
            want = peft_model(base, folders[w] if w >= 0 else None)(
                input_ids=torch.tensor([p])
            ).logits[0, -1]
        torch.testing.assert_close(step_logits[row], want, rtol=1e-4, atol=1e-4)


def test_decode_rows_through_the_pool_after_a_prefill_stay_equal(family_models):
    """Prefill then token-by-token decode with the adapter on every step: the KV written under the
    adapter is read back by later steps, as PEFT's cache does.
    """
    base, adapters = family_models["llama"]
    model, config, weights = _ours(base, [adapters["all"]])
    pool = KVPool(config, 64, BLOCK, torch.float32, torch.device("cpu"))
    prompt, blocks = [5, 9, 33, 7, 81], list(range(8))
    reference = peft_model(base, adapters["all"])
    tokens = list(prompt)
    logits, _ = run_step(model, config, pool, [(prompt, 0, blocks)], lora=(weights, [0]))
    for _ in range(6):
        with torch.no_grad():
            want = reference(input_ids=torch.tensor([tokens])).logits[0, -1]
        torch.testing.assert_close(logits[0], want, rtol=1e-4, atol=1e-4)
        tokens.append(int(logits[0].argmax()))
        logits, _ = run_step(
            model, config, pool, [([tokens[-1]], len(tokens) - 1, blocks)], lora=(weights, [0])
        )


def test_tensor_parallel_halves_sum_to_the_whole_update(family_models):
    """Each rank's A and B as the base weights are split: the column-parallel parts' rows and the
    row-parallel parts' partial products put together give the unsplit adapter's update.
    """
    base, adapters = family_models["llama"]
    _, config, (whole,) = _ours(base, [adapters["all"]])
    identity = whole.identity
    ranks = [
        read_lora(
            adapters["all"],
            identity,
            config,
            make_shard(
                config.num_heads,
                config.num_kv_heads,
                config.intermediate_size,
                config.vocab_size,
                rank=r,
                size=2,
            ),
            torch.float32,
            torch.device("cpu"),
            16,
        )
        for r in range(2)
    ]
    x = torch.randn(3, config.hidden_size)
    hd, q = config.head_dim, config.num_heads * config.head_dim

    def update(w, name, x):  # the projection's output columns lo:hi this adapter changes
        p = w.layers[1][name]
        return (x @ p.a.t()) @ p.dense_b().t(), p.lo, p.hi

    full, lo, hi = update(whole, "qkv", x)
    assert (lo, hi) == (0, q + 2 * config.num_kv_heads * hd)
    q_half, kv_half = q // 2, config.num_kv_heads * hd // 2
    # each rank: its q heads, then its k and v heads
    halves = [update(w, "qkv", x)[0] for w in ranks]
    for part, (start, size) in enumerate(
        [(0, q_half), (q_half, kv_half), (q_half + kv_half, kv_half)]
    ):
        whole_start = [0, q, q + 2 * kv_half][part]
        for r in range(2):
            torch.testing.assert_close(
                halves[r][:, start : start + size],
                full[:, whole_start + r * size : whole_start + (r + 1) * size],
            )
    xo = torch.randn(3, q)
    parts = [
        update(w, "o_proj", xo[:, r * q_half : (r + 1) * q_half])[0] for r, w in enumerate(ranks)
    ]
    torch.testing.assert_close(
        parts[0] + parts[1], update(whole, "o_proj", xo)[0], rtol=1e-5, atol=1e-5
    )
    # what --max-cpu-loras sets aside covers an adapter of the highest rank on every projection
    assert whole.nbytes <= lora_bytes(
        config,
        make_shard(
            config.num_heads, config.num_kv_heads, config.intermediate_size, config.vocab_size
        ),
        8,
        4,
    )


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_fused_cpu_decode_step_adds_each_rows_adapter_as_the_layer_path_does(
    family_models, family
):
    """Decode rows of three adapters and the base, a run of one adapter longer than the native
    kernel takes at once among them, through the fused CPU step (kernels/cpu/lora_rows.h): the layer
    path's logits and PEFT's, and the step's profile counts the adapters' stage.
    """
    from kernels import cpu_native
    from worker.serve.choices import use_fused_decode

    kernels = cpu_native.load()
    if kernels is None:
        pytest.skip("native CPU kernels not built")
    base, adapters = family_models[family]
    names = list(adapters)
    model, config, weights = _ours(base, [adapters[n] for n in names])
    use_fused_decode(model, 1, "fp32")
    assert model.fused is not None
    which = [0, 1, -1, 2] + [1] * 10 + [-1, 0]
    prompts = [[5 + i, 9, 33 + i, 7 + 2 * i, 81][: 2 + i % 4] for i in range(len(which))]
    pool = KVPool(config, 128, BLOCK, torch.float32, torch.device("cpu"))
    blocks = [list(range(4 * i, 4 * i + 4)) for i in range(len(which))]
    first, _ = run_step(
        model,
        config,
        pool,
        [(p, 0, b) for p, b in zip(prompts, blocks, strict=True)],
        backend="cpu",
        lora=(weights, which),
    )
    tokens = [p + [int(t)] for p, t in zip(prompts, first.argmax(-1), strict=True)]
    decode = [([t[-1]], len(t) - 1, b) for t, b in zip(tokens, blocks, strict=True)]
    fused = model.fused
    kernels.decode_profile(True)
    got, _ = run_step(model, config, pool, decode, backend="cpu", lora=(weights, which))
    # the native step ran, and ran the adapters' stage
    assert kernels.decode_profile(False)["lora"] > 0
    model.fused = None
    try:
        want, _ = run_step(model, config, pool, decode, backend="cpu", lora=(weights, which))
    finally:
        model.fused = fused
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for row in (0, 1, 3, 13):
        with torch.no_grad():
            ref = peft_model(base, adapters[names[which[row]]])(
                input_ids=torch.tensor([tokens[row]])
            )
        torch.testing.assert_close(got[row], ref.logits[0, -1], rtol=1e-4, atol=1e-4)

"""A GGUF served with no full-precision copy of it: tensors read from the file by their Hugging Face
names, the matrices and the token table kept as the file's blocks, prefill dequantizing a tile at a
time, and the folder a GGUF is prepared into holding no weights.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.support.forward import BLOCK, run_step
from tests.support.quant import assert_projections_match
from tests.support.tiny import make_tiny_gguf
from worker.model.kv_pool import KVPool
from worker.model.quant_weights import QuantWeight
from worker.model.quantized import QuantizedMatmul
from worker.weights.gguf_blocks import GGUFQuantSource
from worker.weights.loader import load_model

CPU = torch.device("cpu")
# family -> config fields: llama.cpp's permuted llama rows, Qwen2's biases, Qwen3's q/k norms,
FAMILIES = {
    "llama": dict(),  # Phi-3's stacked q/k/v and gate/up
    "llama-tied": dict(tie_word_embeddings=True),
    "qwen2": dict(),
    "qwen3": dict(),
    "phi3": dict(pad_token_id=0),
}


def weightless(folder, to):
    """The folder prepare-model makes of a GGUF: config, tokenizer,
    the file's name; no safetensors.
    """
    to.mkdir()
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, to / f.name)
    gguf = next(to.glob("*.gguf"))
    (to / "pagedserve_model.json").write_text(json.dumps({"model_name": "tiny", "gguf": str(gguf)}))
    return to


def logits(model, config, prompt):
    seqs = [(prompt, 0, list(range(-(-len(prompt) // BLOCK))))]
    return run_step(model, config, KVPool(config, 16, BLOCK, torch.float32, CPU), seqs)[0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_gguf_is_served_from_the_file_with_no_dense_copy(native, tmp_path, family):
    """From a folder holding only the GGUF: the dense load dequantizes the file's tensors (the same
    logits as the dequantized checkpoint), and the quantized load never allocates a projection, the
    head or the token table in fp32 — the blocks serve them, the table looked up row by row — with
    the same logits.
    """
    from worker.weights.gguf import GGUFTensorSource

    name = family.split("-")[0]
    folder = make_tiny_gguf(
        tmp_path / "m", "Q8_0", seed=5, family=name, tables=True, **FAMILIES[family]
    )
    bare = weightless(folder, tmp_path / "bare")
    prompt = [(7 * i) % 380 + 3 for i in range(21)]
    # the dequantized safetensors
    reference, config = load_model(str(folder), "auto", torch.float32, CPU)
    want = logits(reference, config, prompt)

    from_file, _ = load_model(str(bare), "auto", torch.float32, CPU)
    torch.testing.assert_close(logits(from_file, config, prompt), want, atol=1e-4, rtol=1e-4)

    source = GGUFQuantSource(
        next(bare.glob("*.gguf")), config.num_heads, config.num_kv_heads, config.head_dim
    )
    model, _ = load_model(str(bare), "auto", torch.float32, CPU, quantized=source)
    held = {n for n, p in model.named_parameters() if p.numel() == 0}
    assert all(
        any(n.endswith(w) for w in ("qkv", "o_proj", "gate_up", "down"))
        or n in ("embed", "lm_head")
        for n in held
    )
    assert "embed" in held and sum(n.endswith("qkv") for n in held) == config.num_layers
    counts = model.use_quantized(model.file_blocks, QuantizedMatmul(native), keep_dense=False)
    assert counts == {"Q8_0": 4 * config.num_layers + 1} and model.file_blocks == {}
    assert model.embed_q is not None and model.embed.numel() == 0
    torch.testing.assert_close(logits(model, config, prompt), want, atol=2e-3, rtol=1e-3)
    assert isinstance(
        GGUFTensorSource(
            next(bare.glob("*.gguf")), config.num_heads, config.num_kv_heads, config.head_dim
        ).get("model.norm.weight"),
        torch.Tensor,
    )


def test_each_rank_reads_its_share_of_the_file(native, tmp_path):
    """Tensor parallel from the bare file: each rank's quantized and dense loads agree on its
    projections and its rows of the token table.
    """
    folder = make_tiny_gguf(tmp_path / "m", "Q8_0", seed=6, family="llama", tables=True)
    bare = weightless(folder, tmp_path / "bare")
    for rank in range(2):
        dense, config = load_model(str(bare), "auto", torch.float32, CPU, tp_rank=rank, tp_size=2)
        source = GGUFQuantSource(
            next(bare.glob("*.gguf")), config.num_heads, config.num_kv_heads, config.head_dim
        )
        model, _ = load_model(
            str(bare), "auto", torch.float32, CPU, tp_rank=rank, tp_size=2, quantized=source
        )
        model.use_quantized(model.file_blocks, QuantizedMatmul(native), keep_dense=False)
        ids = torch.arange(config.vocab_size)
        lo, hi = model.shard.vocab
        torch.testing.assert_close(model.embed_q(ids[lo:hi] - lo), dense.embed[: hi - lo])
        assert_projections_match(model, dense)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("packing", [False, True])
def test_prefill_dequantizes_a_tile_at_a_time_as_the_whole_weight(
    native, qtype, packing, monkeypatch
):
    """Prefill without a dense copy: tiles of whole 16-row groups (several a segment, a last short
    one) of a stack of two types give what the whole dequantized weight gives.
    """
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from tests.support.quant import random_k_blocks

    rng = torch.Generator().manual_seed(3)
    in_dim = 512
    parts = []
    for rows, kind in ((80, qtype), (48, "Q8_0")):
        if kind.endswith("_K"):
            parts.append(random_k_blocks(np.random.default_rng(rows), rows, in_dim, kind)[0])
            continue
        w = torch.randn(rows, in_dim, generator=rng)
        blocks = quants.quantize(w.numpy(), GGMLQuantizationType[kind])
        parts.append(QuantWeight(torch.from_numpy(blocks.copy()).view(rows, -1), kind, in_dim))
    lib = QuantizedMatmul(native, packing=packing and native.packed_fast, max_kernel_rows=0)
    w = lib.pack(QuantWeight.cat(parts))
    whole = lib.dequantize(w)
    monkeypatch.setattr(QuantizedMatmul, "SCRATCH_VALUES", 32 * in_dim)  # 32-row tiles
    x = torch.randn(40, in_dim, generator=rng)
    bias = torch.randn(128, generator=rng)
    torch.testing.assert_close(lib(x, w, bias), x @ whole.T + bias, atol=1e-4, rtol=1e-4)
    assert lib._scratch.numel() == 32 * in_dim  # never the whole weight


def test_a_gguf_is_prepared_without_weights_unless_its_architecture_needs_them(
    tmp_path, monkeypatch
):
    """Preparing a llama GGUF writes config and tokenizer only (fast, no memory to speak of); a
    Qwen3-MoE GGUF, whose tensors the workers do not map, still needs its fp32 copy.
    """
    from deploy.prepare_model import model_folder, needs_dense_copy

    monkeypatch.setenv("PAGEDSERVE_MODELS", str(tmp_path / "cache"))
    llama = next(make_tiny_gguf(tmp_path / "llama", "Q8_0", seed=1).glob("*.gguf"))
    moe = next(make_tiny_gguf(tmp_path / "moe", "Q8_0", seed=1, family="qwen3_moe").glob("*.gguf"))
    out = model_folder(str(llama))
    names = {
        p.name for p in (tmp_path / "cache").glob("*/*") if p.parent.name == out.split("/")[-1]
    }
    assert {"config.json", "tokenizer.json", "pagedserve_model.json"} <= names
    assert not any(n.endswith(".safetensors") for n in names)
    assert needs_dense_copy(moe) and not needs_dense_copy(llama)
    # a folder prepared with an fp32 copy (by a reader that did not map the file) is made again
    (Path(out) / "model.safetensors").write_bytes(b"stale")
    assert model_folder(str(llama)) == out and not (Path(out) / "model.safetensors").exists()
    assert (Path(out) / "config.json").is_file()


def test_serving_a_gguf_counts_its_blocks_not_an_fp32_copy(tmp_path, monkeypatch):
    """The memory check before loading counts a GGUF served on its blocks at the file's size:
    refused with the file's bytes where they do not fit, where an fp32 copy would have been counted
    four times over.
    """
    from argparse import Namespace

    from worker.serve import choices as worker_main
    from worker.weights.loader import load_config

    folder = make_tiny_gguf(tmp_path / "m", "Q8_0", seed=2, family="llama", tables=True)
    gguf = next(folder.glob("*.gguf"))
    config = load_config(str(folder), "auto")
    source = GGUFQuantSource(gguf, config.num_heads, config.num_kv_heads, config.head_dim)
    held = source.held_bytes(config.tie_word_embeddings)
    assert gguf.stat().st_size * 0.9 < held < gguf.stat().st_size * 1.1
    args = Namespace(num_blocks=4, block_size=16, kv_cache_memory=None, tensor_parallel_size=1)
    kv = worker_main.kv_budget_bytes(args, config, torch.float32)
    monkeypatch.setattr("worker.serve.memory_plan.available_bytes", lambda: held + kv + 1)
    assert (
        worker_main.refuse_what_cannot_fit(args, config, torch.float32, torch.float32, 1, source)
        is None
    )
    # fp32: 3.6x the bytes
    assert (
        worker_main.refuse_what_cannot_fit(args, config, torch.float32, torch.float32, 1)
        is not None
    )
    monkeypatch.setattr("worker.serve.memory_plan.available_bytes", lambda: held // 2)
    message = worker_main.refuse_what_cannot_fit(
        args, config, torch.float32, torch.float32, 1, source
    )
    assert gguf.name in message and "on its own blocks" in message


def test_a_llama3_gguf_rotates_by_its_rope_freqs_as_the_scaling_they_came_from(tmp_path):
    """llama.cpp's converter writes a Llama 3.x model's rope scaling as a rope_freqs tensor (each
    frequency's divisor), not as metadata: the file, and the folder prepared from it, rotate as the
    Hugging Face config with that llama3 scaling does, and the model's cos/sin tables follow.
    """
    import dataclasses

    from worker.model.elementwise import Rotary
    from worker.weights.loader import load_config

    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    plain = load_config(str(make_tiny_gguf(tmp_path / "plain")), "auto")
    assert plain.rope_freq_factors == ()
    scaled = dataclasses.replace(plain, rope_scaling=llama3)
    factors = [a / b for a, b in zip(plain.rope_inv_freq(), scaled.rope_inv_freq(), strict=True)]
    assert len(set(round(f, 3) for f in factors)) > 2  # kept, divided by 8, and smoothed between
    folder = make_tiny_gguf(tmp_path / "llama3", rope_freqs=factors)
    for config in (
        load_config(str(folder), "auto"),
        load_config(str(next(folder.glob("*.gguf"))), "gguf"),
    ):
        assert config.rope_freq_factors == pytest.approx(factors)
        assert config.rope_inv_freq() == pytest.approx(scaled.rope_inv_freq(), rel=1e-6)
        assert config.fingerprint("m") != plain.fingerprint("m")
        torch.testing.assert_close(
            Rotary(config, torch.device("cpu")).cos, Rotary(scaled, torch.device("cpu")).cos
        )
    with pytest.raises(Exception, match="rope_freqs holds 3 factors"):
        dataclasses.replace(plain, rope_freq_factors=(1.0, 2.0, 3.0)).rope_inv_freq()

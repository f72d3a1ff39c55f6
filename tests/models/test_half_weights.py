"""`--dtype bfloat16` (or float16) on a CPU: the checkpoint's matrices held as bf16 rows (half
fp32's bytes) and read by the native row kernels with fp32 activations (16 bits of each on AMX
tiles), many rows through the CPU's bf16 GEMM where it has one; norms, activations and the KV cache
in fp32.
"""

import pytest
import torch

from tests.support.forward import BLOCK, run_step
from tests.support.tiny import hf_greedy, make_tiny_llama
from worker.model.kv_pool import KVPool
from worker.model.linear import native_bf16
from worker.model.quantized import QuantizedMatmul
from worker.weights.gguf_blocks import CastSource
from worker.weights.loader import load_config, load_model, tensor_source

CPU = torch.device("cpu")


def rounded(folder, to):
    """The same model with every matrix rounded to bf16 (saved in fp32): what bf16 weights hold."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, to)
    state = load_file(str(to / "model.safetensors"))
    save_file(
        {k: v.bfloat16().float() if v.dim() == 2 else v for k, v in state.items()},
        str(to / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return to


@pytest.mark.parametrize("tied", [False, True])
def test_bf16_weights_give_the_rounded_models_logits(native, tmp_path, tied):
    """Every projection, the head and the token table as bf16 rows (none of them allocated in fp32):
    the logits are the fp32 model's on bf16-rounded matrices — to fp32 rounding through the row
    kernels, to bf16 activation rounding through the bf16 GEMM and AMX tiles.
    """
    folder = make_tiny_llama(tmp_path / "m", seed=3, tie_word_embeddings=tied)
    config = load_config(str(folder), "auto")
    prompt = [(7 * i) % 380 + 3 for i in range(21)]
    seqs = [(prompt, 0, list(range(-(-len(prompt) // BLOCK))))]
    reference, _ = load_model(str(rounded(folder, tmp_path / "r")), "auto", torch.float32, CPU)
    want = run_step(reference, config, KVPool(config, 16, BLOCK, torch.float32, CPU), seqs)[0]

    lib = QuantizedMatmul(native)
    source = CastSource(tensor_source(str(folder), "auto", config), config)
    model, _ = load_model(str(folder), "auto", torch.float32, CPU, quantized=source, pack=lib.pack)
    # no fp32 matrix
    assert all(p.numel() == 0 for n, p in model.named_parameters() if p.dim() == 2)
    assert model.use_quantized(model.file_blocks, lib, keep_dense=False) == {
        "BF16": 4 * config.num_layers + 1
    }
    lib.max_kernel_rows = 1 << 30  # the row kernels: fp32 activations (AMX tiles refused)
    native.bf16_rounded(0)
    try:
        got = run_step(model, config, KVPool(config, 16, BLOCK, torch.float32, CPU), seqs)[0]
    finally:
        native.bf16_rounded(1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # bf16 activations: prefill's path (the bf16 GEMM or a dense tile), and the row kernels on
    # AMX tiles where the CPU has them
    for rows in (0, 1 << 30):
        lib.max_kernel_rows = rows
        got = run_step(model, config, KVPool(config, 16, BLOCK, torch.float32, CPU), seqs)[0]
        torch.testing.assert_close(got, want, atol=0.05 * want.abs().max().item(), rtol=0.05)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def test_a_bf16_gemm_keeps_its_gate_up_in_bf16_through_the_silu_mul_with_the_same_values(native):
    """Through the bf16 GEMM the MLP's gate/up goes on in bf16 (bf16_out) into a bf16 SiLU·mul and
    the down GEMM: the values of the fp32 round trip it replaces, bit for bit (fp32 arithmetic on
    the widened values, one rounding to nearest even), with no fp32 copy on either side; the row
    kernels' path stays fp32.
    """
    from worker.model.elementwise import NativeOps
    from worker.model.quant_weights import QuantWeight

    if not native_bf16():
        pytest.skip("no bf16 GEMM on this CPU: prompt chunks take the fp32 tiles")
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 64, generator=g) * 0.3).to(torch.bfloat16)
    q = QuantWeight(w.view(torch.uint8), "BF16", 64)
    lib = QuantizedMatmul(native)
    lib.max_kernel_rows = 4
    x = torch.randn(40, 64, generator=g) * 3
    gate_up = lib(x, q, bf16_out=True)
    assert gate_up.dtype == torch.bfloat16 and torch.equal(gate_up.float(), lib(x, q))
    ops = NativeOps(native)
    act = ops.silu_mul(gate_up)
    assert act.dtype == torch.bfloat16 and torch.equal(
        act, ops.silu_mul(gate_up.float()).to(torch.bfloat16)
    )
    assert lib(x[:3], q, bf16_out=True).dtype == torch.float32  # a few rows: the row kernel, fp32
    down = QuantWeight(w[:, :48].contiguous().view(torch.uint8), "BF16", 48)
    # a bf16 input is multiplied as it is
    assert torch.equal(lib(act, down), lib(act.float(), down))


@pytest.mark.slow
def test_a_checkpoint_served_in_bf16_answers_as_its_rounded_weights(
    server_factory, native, tmp_path_factory
):
    """`--dtype bfloat16` on a CPU: the worker holds bf16 matrices and computes in fp32 (AMX tiles
    round the matrices' activations to bf16), so every greedy answer equals transformers' on the
    bf16-rounded weights (prefill on the fp32 copy of
    those values, asked for; the KV pool kept fp32 here: by default it is bf16 too).
    """
    from protos import generation_pb2 as pb

    base = tmp_path_factory.mktemp("bf16")
    folder = make_tiny_llama(base / "m", seed=7)
    server = server_factory(
        folder,
        "--dtype",
        "bfloat16",
        "--quantized-prefill",
        "dense",
        "--block-size",
        "4",
        "--num-blocks",
        "256",
        "--kv-cache-dtype",
        "fp32",
    )
    log = server.log_path.read_text()
    assert '"matrices": {"BF16": 13}' in log and '"compute_dtype": "float32"' in log
    assert '"prefill_attention"' not in log  # fp32 prompt chunks over an fp32 pool: fp32 attention
    reference = rounded(folder, base / "r")
    for prompt in ([5, 9, 13, 200, 31], list(range(40, 75))):
        req = pb.GenerateRequest(
            prompt_token_ids=prompt,
            sampling=pb.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
        )
        assert list(server.stub.Generate(req, timeout=120).choices[0].token_ids) == hf_greedy(
            reference, prompt, 20
        )
    # the default: prefill through the CPU's bf16 GEMM where it has one (no fp32 copy), else as
    # memory allows; with the bf16 GEMM, prompt chunks attend over the bf16 pool in bf16 dot
    # products where the CPU has them
    auto = server_factory(folder, "--dtype", "bfloat16", "--block-size", "4", "--num-blocks", "256")
    reason = "the CPU's bf16 GEMM" if native_bf16() else "available"
    log = auto.log_path.read_text()
    assert reason in log and '"kv_cache_dtype": "bfloat16"' in log
    # "bfloat16" says it
    assert auto.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).weights == ""
    dots = native_bf16() and native.prefill_bf16_dots
    assert ('"arithmetic": "bf16 dot products"' in log) == dots
    req = pb.GenerateRequest(
        prompt_token_ids=list(range(40, 75)),
        sampling=pb.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True),
    )
    assert len(auto.stub.Generate(req, timeout=120).choices[0].token_ids) == 20


def test_bf16_weights_in_the_gemms_blocked_layout_give_the_plain_gemms_products(
    native, monkeypatch
):
    """Where the CPU multiplies bf16 (AMX), a BF16 weight may be held a second time in oneDNN's
    blocked layout for steps past the row kernels' limit: the products of the plain bf16 GEMM, bit
    for bit, at a decode batch's rows and a prompt chunk's, in fp32 and kept in bf16 for the
    SiLU·mul; the row kernels still read the rows as held. The choice to hold it follows the memory
    left.
    """
    from worker.model.quant_weights import QuantLinear, QuantWeight
    from worker.serve.memory_plan import GiB, choose_gemm_copy

    if not native_bf16():
        pytest.skip("no bf16 GEMM on this CPU: nothing is held twice")
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(160, 96, generator=g) * 0.3).to(torch.bfloat16)
    lib = QuantizedMatmul(native)
    lib.max_kernel_rows = 4
    plain = QuantLinear(QuantWeight(w.view(torch.uint8), "BF16", 96))
    blocked = QuantLinear(QuantWeight(w.view(torch.uint8), "BF16", 96))
    assert lib.gemm_copy_bytes([plain, blocked]) == 2 * w.numel() * 2
    assert lib.hold_gemm([blocked]) == 1 and blocked.q.gemm is not None and plain.q.gemm is None
    calls = []
    blocked_gemm = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(
        torch.ops.mkldnn,
        "_linear_pointwise",
        lambda *a: calls.append(a[0].shape[0]) or blocked_gemm(*a),
    )
    for rows in (3, 16, 64, 300):
        x = torch.randn(rows, 96, generator=g) * 2
        for bf16_out in (False, True):
            got, want = lib(x, blocked, bf16_out=bf16_out), lib(x, plain, bf16_out=bf16_out)
            assert got.dtype == want.dtype and torch.equal(got, want), (rows, bf16_out)
    # the blocked copy past the row kernels' 4 rows, only there
    assert calls == [
        16,
        16,
        64,
        64,
        300,
        300,
    ]
    held, _ = choose_gemm_copy(2 * GiB, GiB, 20 * GiB)
    refused, why = choose_gemm_copy(2 * GiB, GiB, 4 * GiB)
    assert held and not refused and "cannot hold it (2.0 GiB)" in why

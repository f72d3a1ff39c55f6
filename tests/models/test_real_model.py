"""A few checks on the embedded default model (SmolLM2-135M-Instruct, prepared by `make setup`)."""

import os
from pathlib import Path

import pytest
import torch

from deploy.processes import ROOT
from protos import generation_pb2
from tests.support.tiny import hf_greedy

MODEL_DIR = Path(os.environ.get("PAGEDSERVE_MODEL_DIR", ROOT / ".models" / "smollm2-135m-instruct"))

pytestmark = [
    pytest.mark.real_model,
    pytest.mark.skipif(
        not (MODEL_DIR / "model.safetensors").exists(),
        reason=f"default model not prepared in {MODEL_DIR} (run `make setup`)",
    ),
]


def test_own_forward_greedy_equals_transformers_on_the_default_model():
    from scheduler_service.text.tokenizer import Tokenizer
    from worker.model.attention_native import make_backend
    from worker.model.kv_pool import KVPool
    from worker.model.llama import StepInputs
    from worker.weights.loader import load_model

    model, config = load_model(str(MODEL_DIR), "auto", torch.float32, torch.device("cpu"))
    prompt = Tokenizer(MODEL_DIR).encode_prompt("Name three colors.", raw=False)
    block = 16
    pool = KVPool(config, 8, block, torch.float32, torch.device("cpu"))
    blocks = [6, 2, 7, 0, 5]
    attn = make_backend("torch", torch.device("cpu"))
    tokens = list(prompt)
    start = 0
    out = []
    with torch.no_grad():
        for _ in range(12):
            new = tokens[start:]
            pos = list(range(start, len(tokens)))
            slots = [blocks[p // block] * block + p % block for p in pos]
            meta = attn.prepare(
                torch.tensor([blocks], dtype=torch.int32),
                torch.tensor([len(tokens)], dtype=torch.int32),
                torch.tensor([0, len(new)], dtype=torch.int32),
                block,
                len(tokens),
                len(new),
            )
            hidden = model(
                StepInputs(torch.tensor(new), torch.tensor(pos), torch.tensor(slots), meta),
                pool,
                attn,
            )
            nxt = int(model.compute_logits(hidden[-1:]).argmax())
            start = len(tokens)
            tokens.append(nxt)
            out.append(nxt)
    assert out == hf_greedy(MODEL_DIR, prompt, 12)


@pytest.mark.slow
def test_make_run_answers_the_capital_of_france(server_factory):
    server = server_factory(MODEL_DIR, "--kv-cache-memory", "256MiB", "--max-model-len", "4096")
    req = generation_pb2.GenerateRequest(
        prompt="What is the capital of France?",
        sampling=generation_pb2.SamplingParams(max_tokens=40),
    )
    resp = server.stub.Generate(req, timeout=120)
    assert "Paris" in resp.choices[0].text
    assert resp.choices[0].finish_reason == generation_pb2.STOP  # it ends on <|im_end|>
    streamed = "".join(m.text for m in server.stub.GenerateStream(req, timeout=120))
    assert streamed == resp.choices[0].text


def test_gguf_loads_directly_and_matches_the_prepared_folder():
    """--model file.gguf: dequantized through transformers, same weights as the prepared folder."""
    from deploy.prepare_model import find_embedded_gguf
    from worker.weights.loader import load_model

    try:
        gguf = os.environ.get("PAGEDSERVE_MODEL_GGUF") or str(find_embedded_gguf())
    except (FileNotFoundError, ModuleNotFoundError) as e:
        pytest.skip(f"the embedded GGUF is not installed here ({e})")
    gguf_model, gguf_config = load_model(gguf, "auto", torch.float32, torch.device("cpu"))
    folder_model, folder_config = load_model(
        str(MODEL_DIR), "auto", torch.float32, torch.device("cpu")
    )
    assert gguf_config == folder_config
    for (name, a), (_, b) in zip(
        gguf_model.named_parameters(), folder_model.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_tensor_parallel_3_on_the_default_model_equals_transformers(server_factory):
    """9 query heads and 3 KV heads over three gloo ranks (one
    thread each): the same greedy tokens.
    """
    from scheduler_service.text.tokenizer import Tokenizer
    from tests.support.server import greedy_request

    tok = Tokenizer(MODEL_DIR)
    prompts = [tok.encode_prompt(p, raw=False) for p in ("Name three colors.", "What is 2 + 2?")]
    tp3 = server_factory(
        MODEL_DIR,
        "--tensor-parallel-size",
        "3",
        "--quantized-activations",
        "int16",
        "--quantized-prefill",
        "dense",
        "--kv-cache-memory",
        "64MiB",
        "--max-model-len",
        "1024",
    )
    info = tp3.stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
    assert (info.tensor_parallel_size, info.num_workers) == (3, 3)
    for (
        prompt
    ) in prompts:  # one rank equals transformers too: test_own_forward_greedy_equals_transformers
        got = list(tp3.stub.Generate(greedy_request(prompt, 10), timeout=120).choices[0].token_ids)
        assert got == hf_greedy(MODEL_DIR, prompt, 10)


def _hf_cuda(dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=dtype).cuda().eval()


def _generate(server, prompt_ids, max_tokens, temperature=0.0, seed=None):
    sampling = generation_pb2.SamplingParams(
        max_tokens=max_tokens, temperature=temperature, ignore_eos=True
    )
    if seed is not None:
        sampling.seed = seed
    req = generation_pb2.GenerateRequest(prompt_token_ids=prompt_ids, sampling=sampling)
    return list(server.stub.Generate(req, timeout=120).choices[0].token_ids)


NEAR_TIE = 0.25  # logits within this of the best are a tie bf16 rounding may break either way


def _follows_transformers(hf, prompt, out):
    """Every token chosen greedily is transformers' argmax on the same prefix, or within NEAR_TIE of
    it.
    """
    with torch.no_grad():
        logits = (
            hf(torch.tensor([prompt + out], device="cuda")).logits[0, len(prompt) - 1 : -1].float()
        )
    best = logits.max(dim=-1).values
    chosen = logits.gather(1, torch.tensor(out, device="cuda")[:, None])[:, 0]
    gaps = (best - chosen).tolist()
    return all(g <= NEAR_TIE for g in gaps), gaps


@pytest.mark.slow
def test_on_a_gpu_in_bf16_greedy_follows_transformers_sampling_repeats_backends_agree(
    server_factory,
):
    """The default GPU configuration (bf16, triton kernels, decode graphs, pool from
    --gpu-memory-utilization): the pool lands where the share says, greedy text is transformers'
    (bf16 on the same GPU) up to near ties, seeded sampling repeats, and the torch backend gives the
    same tokens.
    """
    import subprocess

    from scheduler_service.text.tokenizer import Tokenizer

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    share = 0.35
    server = server_factory(
        MODEL_DIR,
        "--dtype",
        "bfloat16",
        "--gpu-memory-utilization",
        str(share),
        "--max-model-len",
        "4096",
    )
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split(",")
    used, total = float(smi[0]), float(smi[1])
    # the worker's share (its CUDA context included)
    assert abs(used / total - share) < 0.03, (
        used,
        total,
    )
    tok = Tokenizer(MODEL_DIR)
    prompts = [
        tok.encode_prompt(p, raw=False)
        for p in ("Name three colors.", "Write a haiku about the sea.", "What is 12 times 7?")
    ]
    greedy = [_generate(server, p, 32) for p in prompts]
    torch_backend = server_factory(
        MODEL_DIR,
        "--dtype",
        "bfloat16",
        "--attention-backend",
        "torch",
        "--kv-cache-memory",
        "1GiB",
        "--max-model-len",
        "4096",
    )
    other = [_generate(torch_backend, p, 32) for p in prompts]
    hf = _hf_cuda(torch.bfloat16)
    for prompt, ours, theirs in zip(prompts, greedy, other, strict=True):
        ok, gaps = _follows_transformers(hf, prompt, ours)
        assert ok, gaps
        ok, gaps = _follows_transformers(hf, prompt, theirs)
        assert ok, gaps
        if ours != theirs:  # the two backends may part only at a near tie
            at = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
            with torch.no_grad():
                logits = hf(torch.tensor([prompt + ours[:at]], device="cuda")).logits[0, -1].float()
            assert abs(float(logits[ours[at]] - logits[theirs[at]])) <= NEAR_TIE
    a = _generate(server, prompts[0], 24, temperature=0.8, seed=5)
    b = _generate(server, prompts[0], 24, temperature=0.8, seed=5)
    c = _generate(server, prompts[0], 24, temperature=0.8, seed=6)
    assert a == b and len(a) == 24 and a != c

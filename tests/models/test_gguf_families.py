"""The late-2026 families and Gemma 2 and 3 as GGUFs that llama.cpp's own converter writes
(convert_hf_to_gguf.py of the pinned llama-cpp-python sdist, fetched once;
deploy/bench/llama_build.py) from the tiny folders the family tests serve: the config read from the
header, every tensor by name, the converter's changes undone (A as -exp(A_log), +1 norms (Gemma's
and others'), squeezed convs, norms by group, Falcon-H1's µP multipliers folded into its weights,
Qwen3-Next's b and a by key head). At F32 the file is equal to transformers on the folder token for
token; at Q8_0 it is served on its own blocks, equal to the same reader on the file's values
dequantized.
"""

from __future__ import annotations

import json

import pytest

from tests.support.families import ATTENTION, RECURRENT
from tests.support.serving import assert_all_blocks_back, submit_all
from tests.support.tiny import hf_greedy, make_tiny_llama, randomize_buffers

pytestmark = pytest.mark.slow

# widths kept multiples of 32 so that the converter writes every matrix as Q8_0 blocks
WIDE = dict(shared_expert_intermediate_size=64)
GEMMA = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=12, tie_word_embeddings=True)
FAMILIES = {
    "qwen3_next": dict(RECURRENT["qwen3_next"], **WIDE),
    "granitemoehybrid": dict(RECURRENT["granitemoehybrid"], shared_intermediate_size=64),
    "nemotron_h": dict(
        RECURRENT["nemotron_h"], intermediate_size=64, moe_shared_expert_intermediate_size=64
    ),
    # llama.cpp gates Mamba2's output, then norms it by groups: a file says nothing else
    "falcon_h1": dict(RECURRENT["falcon_h1"], mamba_norm_before_gate=False),
    "lfm2": RECURRENT["lfm2"],
    # tied, and the experts' weights unscaled: the converter writes no other (as released)
    "lfm2_moe": dict(RECURRENT["lfm2_moe"], tie_word_embeddings=True, routed_scaling_factor=1.0),
    "olmo3": ATTENTION["olmo3"],
    "minimax_m2": ATTENTION["minimax_m2"],
    # llama.cpp's score scale for these sizes is head_dim's; Gemma 3's 6th layer is global, its
    # sliding layers' RoPE its own; Gemma 2's scores and logits soft-capped; both tied, as released
    # (the converter drops a head)
    "gemma3_text": dict(**GEMMA, num_hidden_layers=7),
    "gemma2": dict(**GEMMA),
}
ARCHS = {
    "qwen3_next": "qwen3next",
    "granitemoehybrid": "granitehybrid",
    "nemotron_h": "nemotron_h_moe",
    "falcon_h1": "falcon-h1",
    "lfm2": "lfm2",
    "lfm2_moe": "lfm2moe",
    "olmo3": "olmo2",
    "minimax_m2": "minimax-m2",
    "gemma3_text": "gemma3",
    "gemma2": "gemma2",
}
PROMPTS = [[3 + (11 * i) % 370 for i in range(n)] for n in (5, 23, 61)]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def files(request, tmp_path_factory):
    """-> (family, the folder, its F32 file, its Q8_0 file)."""
    from deploy.bench.llama_build import convert

    name = request.param
    root = tmp_path_factory.mktemp(name)
    folder = make_tiny_llama(root / "hf", seed=7, family=name, **FAMILIES[name])
    randomize_buffers(folder, ("e_score_correction_bias", "expert_bias"))  # written as exp_probs_b
    tokenizer = folder / "tokenizer_config.json"  # Qwen's own class adds a token past the vocab
    tokenizer.write_text(
        json.dumps(
            {**json.loads(tokenizer.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"}
        )
    )
    flags = ("--no-mtp",) if name == "qwen3_next" else ()
    f32 = convert(folder, root / "tiny.F32.gguf", "f32", *flags, any_tokenizer=True)
    q8 = convert(folder, root / "tiny.Q8_0.gguf", "q8_0", *flags, any_tokenizer=True)
    return name, folder, f32, q8


def greedy_from_file(path, prompt: list[int], n: int) -> list[int]:
    """The worker's model read from a GGUF, one request alone, greedy, in this process."""
    import torch

    from tests.support.forward import BLOCK, run_step
    from worker.model.kv_pool import KVPool
    from worker.model.state_pool import StatePool
    from worker.weights.loader import load_model

    model, config = load_model(str(path), "gguf", torch.float32, torch.device("cpu"))
    pool = KVPool(config, 64, BLOCK, torch.float32, torch.device("cpu"))
    slots = {}
    if config.keeps_state:
        pool.states = StatePool(config, 2, torch.float32, torch.device("cpu"), 1)
        slots = dict(state_slots=[0])
    out, start, new = [], 0, list(prompt)
    for _ in range(n):
        logits = run_step(model, config, pool, [(new, start, list(range(40)))], **slots)[0]
        out.append(int(logits[0].argmax()))
        start, new = start + len(new), out[-1:]
    return out


def test_the_header_names_the_architecture_and_the_f32_file_equals_transformers(files):
    from worker.weights.gguf_header import GGUFHeader

    name, folder, f32, _ = files
    assert GGUFHeader(f32).arch == ARCHS[name]
    for prompt in PROMPTS:
        assert greedy_from_file(f32, prompt, 16) == hf_greedy(folder, prompt, 16), name


def test_the_q8_file_is_served_on_its_blocks_and_equals_its_values(files, server_factory):
    from deploy.bench.llama_build import f32_gguf
    from deploy.prepare_model import prepare

    name, _, _, q8 = files
    served = prepare(q8, q8.parent / "served", name, dense=False)
    server = server_factory(
        served,
        *("--block-size", "4", "--max-num-batched-tokens", "32", "--max-model-len", "128"),
        *("--metrics-port", "-1"),
    )
    try:
        counts = next(
            json.loads(line)["matrices"]
            for line in server.log_path.read_text().splitlines()
            if '"matrices"' in line
        )
        # every projection on the file's own blocks (short convs' and Mamba2's too), none dense
        assert counts.get("Q8_0", 0) >= 4 and "dense" not in counts, counts
        results = submit_all(server, [(f"p{i}", p, 16, 0.0) for i, p in enumerate(PROMPTS)], True)
        values = f32_gguf(q8, q8.parent / "dequantized" / "tiny.F32.gguf")
        for i, prompt in enumerate(PROMPTS):
            assert results[f"p{i}"][0] == greedy_from_file(values, prompt, 16), (name, i)
        assert_all_blocks_back(server)
    finally:
        server.stop()

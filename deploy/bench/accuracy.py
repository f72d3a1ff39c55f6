"""Accuracy of the default model as served, measured: `make bench-accuracy`.

Perplexity of a fixed English text (deploy/data/perplexity.txt: public-domain prose, ~1000 tokens)
by the protocol of llama.cpp's `llama-perplexity`, so the figures sit beside that tool's on the same
GGUF: the text's tokens (a BOS first where the GGUF's tokenizer adds one) cut into chunks of --ctx
tokens (the first token of each replaced by BOS in that case), each evaluated alone, and every token
of a chunk's second half scored from the positions before it; PPL = exp(mean negative
log-likelihood).

pagedserve's figures come from the server's own prompt logprobs (SamplingParams.prompt_logprobs: the
raw fp32 log-softmax of each prompt token given the ones before it), computed one token a step so
that every token takes the path generated tokens take (decode steps: the quantized kernels, the
fused step), one server after the other:
  - fp32: the GGUF dequantized (`--dequantize`), the reference;
  - the GGUF's blocks (the default model's: Q4_1) as `make run` serves them
    (`--quantized-activations auto`: packed, with 16-bit integer activations where the CPU has
    AVX-512 VNNI or AVX2);
  - the same blocks with fp32 activations (`--quantized-activations fp32`);
  - the same blocks with int8 activations (`--quantized-activations int8`, llama.cpp's scheme);
  - bf16: the GGUF dequantized, served with --dtype bfloat16 (bf16 weights and, by default, KV
    pool);
  - fp32 weights over a bf16 KV pool (--kv-cache-dtype bf16): what rounding each key and value
    costs;
  - Q8_0: a Q8_0 copy of the file (its values quantized again as llama.cpp's Q8_0 files are: every
    matrix, 1-D tensors F32; made once under ~/.cache/pagedserve-peers), served on its blocks.
With --tokens-per-step 128 every chunk is one prompt step instead (the prompt path: the blocks'
copy, bf16 on AMX), and the blocks with prompts on the fp32 copy (--quantized-prefill dense) run
beside the default. llama.cpp's llama-perplexity runs on the file and on the Q8_0 copy. Beside each,
the mean and largest |difference| of the scored tokens' logprobs from the fp32 server's.

    python -m deploy.bench.accuracy --model .models/smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.support.server import ServerProcess

TEXT = Path(__file__).resolve().parents[1] / "data" / "perplexity.txt"


def chunks(tokens: list[int], ctx: int, bos: int | None) -> list[list[int]]:
    """llama-perplexity's chunks: ctx-token windows, each starting with BOS where the tokenizer adds
    one.
    """
    out = []
    for i in range(len(tokens) // ctx):
        c = list(tokens[i * ctx : (i + 1) * ctx])
        if bos is not None:
            c[0] = bos
        out.append(c)
    return out


def scored_logprobs(server: ServerProcess, chunk_list: list[list[int]]) -> list[float]:
    """The logprob of each scored token (ctx/2 + 1 .. ctx - 1 of each chunk)."""
    from protos import generation_pb2 as pb

    out = []
    for c in chunk_list:
        first = len(c) // 2
        resp = server.stub.Generate(
            pb.GenerateRequest(
                prompt_token_ids=c,
                sampling=pb.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
            ),
            timeout=600,
        )
        lps = resp.prompt_logprobs  # one per prompt token from the second on
        if len(lps) != len(c) - 1:
            raise RuntimeError(f"expected {len(c) - 1} prompt logprobs, got {len(lps)}")
        out += [lps[p - 1].logprob for p in range(first + 1, len(c))]
    return out


def llama_perplexity(gguf: Path, text: Path, ctx: int, threads: int) -> float:
    from deploy.bench.llama_build import build_llama_tool

    binary = build_llama_tool("llama-perplexity")
    run = subprocess.run(
        [
            str(binary),
            "-m",
            str(gguf),
            "-f",
            str(text),
            "-c",
            str(ctx),
            "-b",
            str(ctx),
            "-t",
            str(threads),
        ],
        capture_output=True,
        text=True,
    )
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", run.stdout + run.stderr)
    if run.returncode != 0 or not found:
        raise RuntimeError(
            f"llama-perplexity failed ({run.returncode}): {(run.stdout + run.stderr)[-1500:]}"
        )
    return float(found.group(1))


def gguf_bos(gguf: Path) -> int | None:
    """The BOS id where the GGUF's tokenizer adds one (as llama-perplexity does), else None."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields

    def value(name):
        f = fields.get(name)
        return None if f is None else f.parts[f.data[0]][0]

    return (
        int(value("tokenizer.ggml.bos_token_id")) if value("tokenizer.ggml.add_bos_token") else None
    )


def main(argv: list[str] | None = None) -> int:
    # one function: the benchmark's script, read top to bottom
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", required=True, help="a folder prepared from a GGUF (the default model's)"
    )
    p.add_argument("--text", type=Path, default=TEXT)
    p.add_argument("--ctx", type=int, default=128, help="tokens per chunk (llama-perplexity -c)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp's perplexity tool")
    p.add_argument(
        "--tokens-per-step",
        type=int,
        default=1,
        help="prompt tokens a step computes (1: each as a decode step computes a generated token)",
    )
    args = p.parse_args(argv)
    from scheduler_service.text.tokenizer import Tokenizer
    from worker.weights.gguf_blocks import find_gguf

    gguf = find_gguf(args.model)
    if gguf is None:
        raise SystemExit(
            f"{args.model} names no GGUF file (prepare it from one: pagedserve prepare-model)"
        )
    bos = gguf_bos(gguf)
    tokens = Tokenizer(args.model).encode(args.text.read_text(), add_special_tokens=False)
    tokens = ([bos] if bos is not None else []) + tokens
    chunk_list = chunks(tokens, args.ctx, bos)
    if len(chunk_list) < 2:
        raise SystemExit(f"the text has {len(tokens)} tokens: fewer than two chunks of {args.ctx}")
    from deploy.bench.llama_build import requantized_gguf

    # a Q8_0 file of the same values, as llama.cpp's Q8_0 files are made
    q8 = requantized_gguf(gguf, "Q8_0")
    kind = gguf.stem.rsplit(".", 1)[-1]  # the file's type as its name says it (Q4_1, Q4_K_M, ...)
    runs = [
        ("fp32 (the GGUF dequantized)", Path(args.model), ["--dequantize"]),
        (
            "bf16 (dequantized, --dtype bfloat16)",
            Path(args.model),
            ["--dequantize", "--dtype", "bfloat16"],
        ),
        (
            "fp32, bf16 KV pool (--kv-cache-dtype bf16)",
            Path(args.model),
            ["--dequantize", "--kv-cache-dtype", "bf16"],
        ),
        (f"{kind} blocks, as served (default)", Path(args.model), []),
        (f"{kind} blocks, fp32 activations", Path(args.model), ["--quantized-activations", "fp32"]),
        (f"{kind} blocks, int8 activations", Path(args.model), ["--quantized-activations", "int8"]),
        ("Q8_0 copy of the file, as served", q8, []),
    ]
    # prompt steps: the default's copy (bf16 on AMX) against the fp32 one
    if args.tokens_per_step > 1:
        runs.insert(
            4,
            (
                f"{kind} blocks, prompts on the fp32 copy",
                Path(args.model),
                ["--quantized-prefill", "dense"],
            ),
        )
    results = []
    for name, model, extra in runs:
        log = Path(tempfile.mkdtemp(prefix="pagedserve-accuracy-")) / "server.log"
        # one prompt token a step, so tokens go through the decode path as generated ones do (a
        # whole chunk would take prefill's dense copy, equal to fp32 by construction)
        server = ServerProcess(
            model,
            log,
            "--metrics-port",
            "0",
            "--threads",
            str(args.threads),
            "--max-num-batched-tokens",
            str(args.tokens_per_step),
            *extra,
        ).start(timeout=600)
        try:
            results.append((name, scored_logprobs(server, chunk_list)))
        finally:
            server.stop()
    n = len(results[0][1])
    print(
        f"text: {args.text.name}, {len(tokens)} tokens, {len(chunk_list)} chunks of {args.ctx}, "
        f"{n} tokens scored"
    )
    reference = results[0][1]
    print(f"{'':42} {'PPL':>8} {'mean |Δ logprob|':>17} {'max |Δ logprob|':>16}")
    for name, lps in results:
        ppl = math.exp(-statistics.fmean(lps))
        diffs = [abs(a - b) for a, b in zip(lps, reference, strict=True)]
        print(f"{name:42} {ppl:8.4f} {statistics.fmean(diffs):17.2e} {max(diffs):16.2e}")
    if not args.no_llama_cpp:
        for label, path in ((f"{kind} GGUF", gguf), ("the Q8_0 copy", q8)):
            ppl = llama_perplexity(path, args.text, args.ctx, args.threads)
            print(f"{'llama.cpp llama-perplexity (' + label + ')':42} {ppl:8.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

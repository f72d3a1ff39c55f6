"""Many LoRA adapters against the base model alone, same server, same run: `make bench-lora`.

The model: the 1B-shaped random Llama of `make bench-cpu-scale` (SmolLM2's 49k vocabulary) as
llama.cpp quantized it (Q4_K_M; `--quant BF16` for the bf16 file), or any folder or GGUF with
`--model`. `--adapters` random rank-`--rank` adapters on all seven projections, written in PEFT's
layout (adapter_config.json, adapter_model.safetensors; made once, cached under
~/.cache/pagedserve-peers/lora/), all loaded by one server (`--lora-modules`, `--max-loras` and the
workers' slots as many). In alternating rounds:
  - one stream: the workload's first prompt, greedy tokens after the first, base and with one
    adapter;
  - N streams (16, 64) of the workload's first N prompts at once, on the base model, then with each
    stream's adapter drawn from 1, 8 and 64 adapters (stream i takes adapter i mod K).
  - llama.cpp's llama-server on the same GGUF, one stream, without and with the first adapter as its
    own convert_lora_to_gguf.py writes it (`--lora`), in the same rounds (`--no-llama-cpp` skips
    it).
The prefix cache is off: every pass computes its prompts (the same prompts come back each round,
under other adapters). Prints output tokens/s (mean TTFT) of each, and each ratio to the base
model's in the same round.

    python -m deploy.bench.lora --streams 16,64 --pools 1,8,64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

from deploy.bench.harness import DEFAULT_WORKLOAD, drive, load_workload
from deploy.bench.llama_build import CACHE
from tests.support.server import ServerProcess

MODULES = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def write_adapters(folder: Path, count: int, rank: int) -> list[Path]:
    """`count` random rank-`rank` adapters on every projection, PEFT's names; made once."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    config = json.loads((folder / "config.json").read_text())
    h, heads = config["hidden_size"], config["num_attention_heads"]
    hd = config.get("head_dim") or h // heads
    q, kv, inter = (
        heads * hd,
        config.get("num_key_value_heads", heads) * hd,
        config["intermediate_size"],
    )
    shapes = {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (inter, h),
        "up_proj": (inter, h),
        "down_proj": (h, inter),
    }
    root = CACHE / "lora" / f"{folder.name}-r{rank}"
    out = []
    for i in range(count):
        path = root / f"a{i}"
        out.append(path)
        if (path / "adapter_model.safetensors").is_file():
            continue
        path.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(i)
        tensors = {}
        for layer in range(config["num_hidden_layers"]):
            for m, part in MODULES.items():
                o, n = shapes[m]
                key = f"base_model.model.model.layers.{layer}.{part}.{m}"
                tensors[f"{key}.lora_A.weight"] = torch.from_numpy(
                    rng.standard_normal((rank, n), dtype=np.float32) * n**-0.5
                ).to(torch.bfloat16)
                tensors[f"{key}.lora_B.weight"] = torch.from_numpy(
                    rng.standard_normal((o, rank), dtype=np.float32) * 0.01
                ).to(torch.bfloat16)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(
            json.dumps(
                {
                    "peft_type": "LORA",
                    "r": rank,
                    "lora_alpha": 2 * rank,
                    "target_modules": list(MODULES),
                    "bias": "none",
                    "use_dora": False,
                    "use_rslora": False,
                    "modules_to_save": None,
                    "task_type": "CAUSAL_LM",
                }
            )
        )
    return out


def llama_cpp_adapter(folder: Path, adapter: Path) -> Path:
    """The adapter as llama.cpp's own convert_lora_to_gguf.py writes it for `--lora` (made once)."""
    import os
    import subprocess

    from deploy.bench.llama_build import CACHE as PEERS
    from deploy.bench.llama_build import build_llama_server

    build_llama_server()  # the sdist's source (and its converter) unpacked once
    out = adapter / "llama.cpp-lora.gguf"
    if not out.is_file():
        source = PEERS / "llama.cpp"
        env = {**os.environ, "PYTHONPATH": str(source / "gguf-py")}
        # the converter reads only the base's config, and its
        with tempfile.TemporaryDirectory() as base:
            # architecture from `architectures`
            config = json.loads((folder / "config.json").read_text())
            config.setdefault("architectures", ["LlamaForCausalLM"])
            (Path(base) / "config.json").write_text(json.dumps(config))
            subprocess.run(
                [
                    sys.executable,
                    str(source / "convert_lora_to_gguf.py"),
                    "--base",
                    base,
                    "--outtype",
                    "f32",
                    "--outfile",
                    str(out),
                    str(adapter),
                ],
                check=True,
                env=env,
                stdout=subprocess.DEVNULL,
            )
    return out


class LlamaCpp:
    """llama-server on the same GGUF, one slot, without or with one adapter (`--lora`)."""

    def __init__(self, gguf: Path, lora: Path | None) -> None:
        from deploy.bench.llama_build import LlamaServer, llama_cpp

        log = Path(tempfile.mkdtemp(prefix="pagedserve-peer-llama-")) / "llama-server.log"
        extra = ["--lora", str(Path(lora).resolve())] if lora is not None else []
        self.server = LlamaServer(llama_cpp(), gguf, 1, 4096, 2, log, *extra).wait()

    def one(self, prompt: list[int], max_tokens: int) -> float:
        from deploy.bench.cpu_peers import LlamaTarget

        return LlamaTarget.one(self, prompt, max_tokens)


def main(argv: list[str] | None = None) -> int:
    # one function: the benchmark's script, read top to bottom
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", default=None, help="a folder or GGUF (default: the 1B shape, --quant)"
    )
    p.add_argument(
        "--quant", default="Q4_K_M", help="with no --model: the 1B shape's file (Q4_K_M, BF16)"
    )
    p.add_argument("--tokenizer-from", type=Path, default=Path(".models/smollm2-135m-instruct"))
    p.add_argument("--adapters", type=int, default=64)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--streams", default="16,64")
    p.add_argument(
        "--pools", default="1,8,64", help="how many adapters the streams' adapters are drawn from"
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    p.add_argument("--serve-flags", default="", help="more flags of the server")
    p.add_argument(
        "--no-llama-cpp",
        action="store_true",
        help="skip llama-server (one stream, without and with the first adapter; GGUF only)",
    )
    args = p.parse_args(argv)
    from deploy.prepare_model import model_folder

    if args.model is None:
        from deploy.bench.cpu_scale import gguf_file

        args.model = str(gguf_file("1b", args.quant, args.tokenizer_from, 49152))
    folder = Path(model_folder(args.model))
    pools = [int(k) for k in args.pools.split(",")]
    streams = [int(n) for n in args.streams.split(",")]
    adapters = write_adapters(folder, max(pools), args.rank)
    names = [f"a{i}" for i in range(len(adapters))]
    prompts = load_workload(args.workload)
    log = Path(tempfile.mkdtemp(prefix="pagedserve-lora-")) / "server.log"
    flags = [
        "--lora-modules",
        *(f"{n}={a}" for n, a in zip(names, adapters, strict=True)),
        "--max-loras",
        str(len(names)),
        "--max-lora-rank",
        str(args.rank),
        "--kv-cache-memory",
        "12GiB",
        "--no-prefix-caching",
        "--metrics-port",
        "0",
        *args.serve_flags.split(),
    ]
    server = ServerProcess(folder, log, *flags).start(timeout=900)
    res: dict[str, list] = {}
    peers = {}
    try:
        # each stopped below, whatever happens
        if not args.no_llama_cpp and args.model.endswith(".gguf"):
            peers["base"] = LlamaCpp(Path(args.model), None)
            peers["1 adapter"] = LlamaCpp(Path(args.model), llama_cpp_adapter(folder, adapters[0]))
        # every adapter read once
        asyncio.run(drive(server.address, [[1, 2, 3]] * len(names), 2, names))

        def one(lora: str, prompt: list[int]) -> float:
            wall, ttfts, n = asyncio.run(drive(server.address, [prompt], args.max_tokens, [lora]))
            return (n - 1) / (wall - ttfts[0])

        for r in range(args.rounds):
            # one stream, a new prompt each (a repeat would draft its earlier answer), base and
            # adapter each
            base, adapted = prompts[(2 * r) % len(prompts)], prompts[(2 * r + 1) % len(prompts)]
            res.setdefault("1 stream, base", []).append((one("", base), 0.0))
            res.setdefault("1 stream, 1 adapter", []).append((one(names[0], adapted), 0.0))
            for label, peer in peers.items():
                res.setdefault(f"llama.cpp 1 stream, {label}", []).append(
                    (peer.one(base if label == "base" else adapted, args.max_tokens), 0.0)
                )
            for n in streams:
                for k in [0, *pools]:
                    loras = [names[i % k] if k else "" for i in range(n)]
                    wall, ttfts, tokens = asyncio.run(
                        drive(server.address, prompts[:n], args.max_tokens, loras)
                    )
                    label = f"{n} streams, " + (
                        f"{k} adapter{'s' if k > 1 else ''}" if k else "base"
                    )
                    res.setdefault(label, []).append((tokens / wall, statistics.mean(ttfts)))
    finally:
        server.stop()
        for peer in peers.values():
            peer.server.stop()
    med = statistics.median
    print(
        f"\nmodel {args.model}; {len(names)} adapters of rank {args.rank} on all seven "
        f"projections; {args.max_tokens} tokens a stream; {args.rounds} rounds"
    )
    print(f"{'':24} {'tok/s':>8} {'TTFT':>7} {'/ base':>7}   each round's ratio")
    for label, runs in res.items():
        base = res[label.split(",")[0] + ", base"]
        ratios = [a[0] / b[0] for a, b in zip(runs, base, strict=True)]
        print(
            f"{label:24} {med(r[0] for r in runs):8.1f} {med(r[1] for r in runs):6.2f}s "
            f"{med(ratios):7.2f}   " + ", ".join(f"{x:.2f}" for x in ratios)
        )
    if peers:
        ours, theirs = res["1 stream, 1 adapter"], res["llama.cpp 1 stream, 1 adapter"]
        ratios = [a[0] / b[0] for a, b in zip(ours, theirs, strict=True)]
        print(
            f"1 stream with the adapter, pagedserve / llama.cpp: {med(ratios):.2f}   "
            + ", ".join(f"{x:.2f}" for x in ratios)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

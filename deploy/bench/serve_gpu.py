"""End-to-end decode benchmark on a GPU (`make bench-serve-gpu`): the whole server — scheduler,
ZeroMQ wire, worker — at real model shapes with dummy weights, driven by the load-test client.

A model folder is made with the shape's config and a word-level tokenizer of its vocabulary size
(nothing is downloaded); `pagedserve serve --load-format dummy` serves it; for each batch B the load
test runs B closed-loop clients with prompts of --context tokens and --output-len new tokens each
(end of sequence ignored). Printed: decode tokens/s (B / the median gap between a request's tokens,
which is one decode step; the steps that prefill the prompts are the long tail, not the median), the
same against the worker's roofline (every weight and every sequence's keys read once a step, over
the device-to-device copy bandwidth), and where a step's time went, from the engine's step profile:
the worker's device time, the share of the step the GPU waits for the host, the scheduler's time and
the worker's host preparation.

    python -m deploy.bench.serve_gpu --shape llama3-8b --batch 1 16 64 256 --context 2048
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from deploy.bench.step import SHAPES, copy_bandwidth


def make_folder(folder: Path, shape: str, max_len: int) -> dict:
    """config.json of the shape and a word-level tokenizer with one token a vocabulary entry."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = dict(
        SHAPES[shape],
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        bos_token_id=1,
        eos_token_id=2,
    )
    cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"], max_len)
    (folder / "config.json").write_text(json.dumps(cfg))
    vocab = {f"w{i}": i for i in range(cfg["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "w1", "eos_token": "w2"})
    )
    return cfg


def profiles(log: Path) -> list[dict]:
    """Every step_profile line of the server's log so far (cumulative figures, oldest first)."""
    out = []
    for line in log.read_text().splitlines():
        if '"step_profile"' in line:
            try:
                out.append(json.loads(line[line.index("{") :]))
            except ValueError:
                continue
    return out


def decode_window(snaps: list[dict]) -> dict | None:
    """Where pure decoding's step time went: the longest run of profiles with no prompt tokens."""
    best, start = None, 0
    for i in range(1, len(snaps) + 1):
        if i == len(snaps) or snaps[i]["prefill_tokens"] != snaps[start]["prefill_tokens"]:
            if i - 1 > start and (
                best is None
                or snaps[i - 1]["steps"] - snaps[start]["steps"]
                > best[1]["steps"] - best[0]["steps"]
            ):
                best = (snaps[start], snaps[i - 1])
            start = i
    if best is None:
        return None
    a, b = best
    return {k: b[k] - a[k] for k in b if isinstance(b[k], (int, float)) and k in a}


def main(argv: list[str] | None = None) -> int:
    # one function: the benchmark's script, read top to bottom
    p = argparse.ArgumentParser(
        prog="pagedserve-bench-serve-gpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--server-args", default="", help="extra flags for the server")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import torch

    from tests.support.server import ServerProcess

    if not torch.cuda.is_available():
        print("bench-serve-gpu needs a CUDA GPU", file=sys.stderr)
        return 2
    bw = copy_bandwidth(torch, torch.device("cuda"))
    torch.cuda.empty_cache()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        folder.mkdir()
        cfg = make_folder(folder, args.shape, args.context + args.output_len + 16)
        log = Path(tmp) / "server.log"
        server = ServerProcess(
            folder,
            log,
            "--load-format",
            "dummy",
            "--max-num-seqs",
            str(max(args.batch)),
            "--max-model-len",
            str(args.context + args.output_len + 16),
            "--max-num-batched-tokens",
            str(max(4096, max(args.batch))),
            "--log-format",
            "json",
            "--step-profile-interval",
            "0.2",
            *args.server_args.split(),
        ).start(timeout=600)
        try:
            head = cfg["hidden_size"] // cfg["num_attention_heads"]
            per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head * 2
            weights = 2 * (
                cfg["vocab_size"] * cfg["hidden_size"] * (1 if cfg["tie_word_embeddings"] else 2)
                + cfg["num_hidden_layers"]
                * (
                    cfg["hidden_size"]
                    * head
                    * (cfg["num_attention_heads"] * 2 + cfg["num_key_value_heads"] * 2)
                    + 3 * cfg["hidden_size"] * cfg["intermediate_size"]
                )
            )
            print(
                f"\nend to end — {torch.cuda.get_device_name()}, {args.shape} (dummy weights, "
                f"bf16), context {args.context}, {args.output_len} new tokens a request, torch "
                f"{torch.__version__}"
            )
            print(
                f"{'batch':>6} {'tok/s':>9} {'ITL ms':>8} {'roof ms':>8} {'of roof':>8} "
                f"{'device':>7} {'idle':>6} {'sched':>6} {'prep':>6}"
            )
            for batch in args.batch:
                seen = len(profiles(log))
                out = Path(tmp) / f"load{batch}.json"
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "deploy.loadtest",
                        "--target",
                        server.address,
                        "--concurrency",
                        str(batch),
                        "--num-requests",
                        str(batch),
                        "--warmup",
                        "0",
                        "--input-len",
                        str(args.context),
                        "--output-len",
                        str(args.output_len),
                        "--no-progress",
                        "--output",
                        str(out),
                    ],
                    check=True,
                    stdout=subprocess.DEVNULL,
                )
                time.sleep(0.5)  # the engine logs its cumulative profile every 0.2 s while busy
                d = decode_window(profiles(log)[seen:])
                r = json.loads(out.read_text())
                tpot = r["itl_ms"]["p50"] / 1000  # the median gap between tokens: a decode step
                roof = (weights + batch * (args.context + args.output_len / 2) * per_token) / bw
                row = dict(
                    batch=batch,
                    tok_s=batch / tpot,
                    tpot_ms=tpot * 1e3,
                    roofline_ms=roof * 1e3,
                    of_roofline=roof / tpot,
                    output_throughput=r["output_throughput"],
                )
                if d is not None and d["steps"] > 0:
                    steps = d["steps"]
                    device = (d["worker_forward"] + d["worker_sample"]) / steps
                    row.update(
                        sched_ms=(d["schedule"] + d["build_plan"] + d["process_output"])
                        / steps
                        * 1e3,
                        prep_ms=d["worker_prepare"] / steps * 1e3,
                        device_ms=device * 1e3,
                        gpu_idle=max(0.0, 1 - device / tpot),
                    )
                rows.append(row)
                nan = float("nan")
                print(
                    f"{batch:>6} {row['tok_s']:>9.0f} {row['tpot_ms']:>8.2f} "
                    f"{row['roofline_ms']:>8.2f} {row['of_roofline']:>8.0%} "
                    f"{row.get('device_ms', nan):>7.2f} {row.get('gpu_idle', nan):>6.0%} "
                    f"{row.get('sched_ms', nan):>6.2f} {row.get('prep_ms', nan):>6.2f}"
                )
        finally:
            server.stop()
            if args.json:
                Path(args.json).write_text(
                    json.dumps(
                        dict(
                            device=torch.cuda.get_device_name(),
                            shape=args.shape,
                            copy_tb_s=bw / 1e12,
                            rows=rows,
                        )
                    )
                )
            tail = log.read_text().splitlines()[-5:] if log.exists() else []
            if not rows:
                print("\n".join(tail))
    print(
        "(ms a decode step, from the engine's profile over the longest stretch without prompt "
        "tokens: device = the worker's forward + sampling on the GPU; idle = the share of a step "
        "the GPU waits for the host; sched = the scheduler's scheduling, plan building and "
        "output processing, which overlap the device; prep = the worker's decoding, checking and "
        "staging of a plan)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

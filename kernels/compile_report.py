"""What the Triton kernels compile to: registers, spills, shared memory, and how many versions of
each.

Two ways to read it: - `offline_report()` compiles every Triton kernel of kernels/ for a CUDA
target (sm_90 by default) without a GPU, at the launch configurations the launchers choose for each
head_dim and block size, and reads registers and spill bytes from ptxas (`make gpu-compile-report`).
- `runtime_report()` lists what this process has compiled and launched so far (on a GPU: registers
and spills as the driver loaded them) — one entry per compiled version, so a kernel that was
compiled again for a step of another shape shows up as two.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from protos.base import env


def _jit_functions():
    from kernels import (
        triton_attention,
        triton_elementwise,
        triton_lora,
        triton_moe,
        triton_sampling,
        triton_ssd,
    )

    out = {}
    for module in (
        triton_attention,
        triton_elementwise,
        triton_sampling,
        triton_moe,
        triton_lora,
        triton_ssd,
    ):
        for name in dir(module):
            obj = getattr(module, name)
            if hasattr(obj, "device_caches") and hasattr(obj, "arg_names"):
                out[name] = obj
    return out


def runtime_report() -> dict[str, list[dict]]:
    """kernel name -> one dict per compiled version: regs, spills, shared bytes, warps, stages."""
    report: dict[str, list[dict]] = {}
    for name, fn in _jit_functions().items():
        versions = []
        for caches in fn.device_caches.values():
            kernel_cache = caches[0]
            for kernel in kernel_cache.values():
                meta = kernel.metadata
                versions.append(
                    dict(
                        regs=getattr(kernel, "n_regs", None),
                        spills=getattr(kernel, "n_spills", None),
                        shared=meta.shared,
                        num_warps=meta.num_warps,
                        num_stages=meta.num_stages,
                    )
                )
        if versions:
            report[name] = versions
    return report


def print_runtime_report(report: dict[str, list[dict]] | None = None, file=sys.stdout) -> None:
    report = runtime_report() if report is None else report
    print(
        f"{'kernel':<28} {'versions':>8} {'regs':>5} {'spills':>7} {'shared':>7} {'warps':>5} "
        f"{'stages':>6}",
        file=file,
    )
    for name, versions in sorted(report.items()):
        for i, v in enumerate(versions):
            print(
                f"{name if i == 0 else '':<28} {len(versions) if i == 0 else '':>8} "
                f"{v['regs']!s:>5} {v['spills']!s:>7} {v['shared']:>7} {v['num_warps']:>5} "
                f"{v['num_stages']:>6}",
                file=file,
            )


# --- offline: compile for a CUDA target without a GPU ---------------------------------------------

_PTXAS_LINE = re.compile(r"Used (\d+) registers.*?(?:(\d+) bytes spill stores)?", re.S)


def ptxas_usage(ptx: str, capability: int) -> dict:
    """Registers and spills of a PTX module, from Triton's ptxas -v."""
    import inspect

    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(capability) if inspect.signature(get_ptxas).parameters else get_ptxas()
    path = ptxas.path if hasattr(ptxas, "path") else ptxas[0]
    arch = f"sm_{capability}a" if capability == 90 else f"sm_{capability}"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        done = subprocess.run(
            [path, "-v", f"--gpu-name={arch}", str(src), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        )
    text = done.stdout + done.stderr
    regs = int(re.search(r"Used (\d+) registers", text).group(1))
    stores = re.search(r"(\d+) bytes spill stores", text)
    loads = re.search(r"(\d+) bytes spill loads", text)
    stack = re.search(r"(\d+) bytes stack frame", text)
    return dict(
        regs=regs,
        spill_stores=int(stores.group(1)) if stores else 0,
        spill_loads=int(loads.group(1)) if loads else 0,
        stack=int(stack.group(1)) if stack else 0,
    )


def compile_offline(
    fn,
    signature: dict,
    constexprs: dict,
    num_warps: int,
    num_stages: int,
    capability: int = 90,
    aligned: tuple[str, ...] = (),
) -> dict:
    """Compile a kernel for `capability` without a GPU -> regs, spills, shared bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {}
    for name in fn.arg_names:
        sig[name] = "constexpr" if name in constexprs else signature[name]
    attrs = {
        (fn.arg_names.index(a),): [["tt.divisibility", 16]]
        for a in aligned
        if a in fn.arg_names and a not in constexprs
    }
    src = ASTSource(
        fn,
        sig,
        constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
        attrs=attrs,
    )
    target = GPUTarget("cuda", capability, 32)
    compiled = triton.compile(
        src, target=target, options=dict(num_warps=num_warps, num_stages=num_stages)
    )
    usage = ptxas_usage(compiled.asm["ptx"], capability)
    return dict(usage, shared=compiled.metadata.shared, num_warps=num_warps, num_stages=num_stages)


def offline_report(
    head_dims=(64, 128, 256, 512),
    block_sizes=(16, 32, 256),
    capability: int = 90,
    dtype: str = "bf16",
) -> list[dict]:
    """Every attention and elementwise kernel at the configurations its launcher picks on a GPU."""
    from kernels import triton_configs as ta
    from kernels import triton_elementwise as te
    from kernels import triton_lora as tlora
    from kernels import triton_moe as tmoe
    from kernels import triton_sampling as tsamp
    from kernels import triton_ssd as tssd

    rows = []
    for case in (
        ta.launch_cases(head_dims, block_sizes, dtype)
        + te.launch_cases(head_dims, dtype)
        + tsamp.launch_cases()
        + tmoe.launch_cases(dtype)
        + tlora.launch_cases(dtype)
        + tssd.launch_cases()
    ):
        usage = compile_offline(
            case["fn"],
            case["signature"],
            case["constexprs"],
            case["num_warps"],
            case["num_stages"],
            capability,
            case.get("aligned", ()),
        )
        rows.append(dict(name=case["name"], **usage))
    return rows


def main(argv: list[str] | None = None) -> int:
    if env.triton_interpreted():
        print(
            "gpu-compile-report compiles for a GPU: run it without TRITON_INTERPRET=1",
            file=sys.stderr,
        )
        return 2
    # what Triton does today, without its warning
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    p = argparse.ArgumentParser(
        prog="gpu-compile-report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--capability", type=int, default=90, help="CUDA compute capability (90: H100/H200)"
    )
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128, 256, 512])
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 32, 256])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = p.parse_args(argv)
    rows = offline_report(
        tuple(args.head_dims), tuple(args.block_sizes), args.capability, args.dtype
    )
    if args.json:
        print(json.dumps(rows))
        return 1 if any(r["spill_stores"] for r in rows) else 0
    print(f"sm_{args.capability}, {args.dtype}")
    print(
        f"{'kernel':<44} {'regs':>5} {'spill st':>8} {'spill ld':>8} {'stack':>6} {'shared':>7} "
        f"{'warps':>5} {'stages':>6}"
    )
    spilled = 0
    for r in rows:
        print(
            f"{r['name']:<44} {r['regs']:>5} {r['spill_stores']:>8} {r['spill_loads']:>8} "
            f"{r['stack']:>6} {r['shared']:>7} {r['num_warps']:>5} {r['num_stages']:>6}"
        )
        spilled += r["spill_stores"] > 0
    print(f"{len(rows)} kernel configurations, {spilled} spill")
    return 1 if spilled else 0


if __name__ == "__main__":
    sys.exit(main())

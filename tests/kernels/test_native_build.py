"""The native CPU library's build: what goes into its cache key, so an edit never reuses a stale
library.
"""

import re
import shutil

import pytest

from kernels import cpu_build


@pytest.fixture
def sources(tmp_path):
    folder = tmp_path / "cpu"
    shutil.copytree(cpu_build.SOURCE_DIR, folder)
    return folder


def test_every_source_and_header_is_compiled_or_hashed(sources):
    on_disk = {p.name for p in sources.iterdir() if p.suffix in (".c", ".h")}
    assert {p.name for p in cpu_build.build_inputs(sources)} == on_disk
    included = {
        m
        for p in sources.iterdir()
        if p.suffix in (".c", ".h")
        for m in re.findall(r'#include "([^"]+)"', p.read_text())
    }
    assert included <= on_disk, "a header the sources include is not in the folder"


@pytest.mark.parametrize("name", sorted(p.name for p in cpu_build.build_inputs()))
def test_an_edit_to_any_one_file_changes_the_library_it_builds(sources, name):
    cc = shutil.which("cc") or shutil.which("gcc") or "cc"
    before = cpu_build.build_key(cc, sources)
    (sources / name).write_text((sources / name).read_text() + "\n/* edited */\n")
    assert cpu_build.build_key(cc, sources) != before, (
        f"{name} edited alone would reuse a stale library"
    )


def test_a_renamed_file_changes_the_library_it_builds(sources):
    cc = shutil.which("cc") or "cc"
    before = cpu_build.build_key(cc, sources)
    header = next(p for p in sorted(sources.glob("*.h")))
    header.rename(sources / ("x_" + header.name))
    assert cpu_build.build_key(cc, sources) != before


def _defined_entry_points() -> set[str]:
    found = set()
    for c in cpu_build.sources():
        found |= set(
            re.findall(r"^(?!static)[\w ]+?\**\s*(pagedserve_\w+)\s*\(", c.read_text(), re.M)
        )
    return found


def test_every_entry_point_is_declared_once_in_the_public_header():
    header = (cpu_build.SOURCE_DIR / "pagedserve.h").read_text()
    declared = re.findall(r"(pagedserve_\w+)\s*\(", header)
    assert sorted(set(declared)) == sorted(declared), "declared twice"
    assert _defined_entry_points() == set(declared)
    for c in cpu_build.sources():
        assert '#include "pagedserve.h"' in c.read_text(), (
            f"{c.name} does not include the public header"
        )


def test_the_binding_reads_each_signature_from_the_header():
    import ctypes

    from kernels import cpu_native

    protos = cpu_native.prototypes((cpu_build.SOURCE_DIR / "pagedserve.h").read_text())
    assert set(protos) == _defined_entry_points()
    restype, args = protos["pagedserve_paged_decode"]
    assert restype is None and len(args) == 18
    assert args[:8] == [ctypes.c_void_p] * 6 + [ctypes.c_int64, ctypes.c_void_p]
    assert args[13] is ctypes.c_float and args[-1] is ctypes.c_int32
    assert args[16] is ctypes.c_void_p  # the sinks (gpt-oss), NULL for every other model
    assert protos["pagedserve_decode_step_scratch"][0] is ctypes.c_int64
    assert protos["pagedserve_native_isa"] == (ctypes.c_int, [])


def test_the_fused_steps_structs_match_the_librarys(native):
    from kernels.cpu_step import mirrors_match

    # model, layers, the LoRA pair and the experts
    assert len(native.struct_sizes) == 7 and mirrors_match(native)


def test_half_width_conversions_are_defined_once():
    """bf16 and fp16 to and from fp32 live in convert.h; every other file calls them."""
    defs = {}
    for path in cpu_build.build_inputs():
        for name in re.findall(r"static inline \w+ (\w*(?:bf16|half)\w*)\s*\(", path.read_text()):
            defs.setdefault(name, []).append(path.name)
    assert defs and all(files == ["convert.h"] for files in defs.values()), defs

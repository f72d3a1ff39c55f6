"""The native CPU library's build: what goes into its cache key, so an edit never reuses a stale library."""

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
    included = {m for p in sources.iterdir() if p.suffix in (".c", ".h")
                for m in re.findall(r'#include "([^"]+)"', p.read_text())}
    assert included <= on_disk, "a header the sources include is not in the folder"


@pytest.mark.parametrize("name", sorted(p.name for p in cpu_build.build_inputs()))
def test_an_edit_to_any_one_file_changes_the_library_it_builds(sources, name):
    cc = shutil.which("cc") or shutil.which("gcc") or "cc"
    before = cpu_build.build_key(cc, sources)
    (sources / name).write_text((sources / name).read_text() + "\n/* edited */\n")
    assert cpu_build.build_key(cc, sources) != before, f"{name} edited alone would reuse a stale library"


def test_a_renamed_file_changes_the_library_it_builds(sources):
    cc = shutil.which("cc") or "cc"
    before = cpu_build.build_key(cc, sources)
    header = next(p for p in sorted(sources.glob("*.h")))
    header.rename(sources / ("x_" + header.name))
    assert cpu_build.build_key(cc, sources) != before

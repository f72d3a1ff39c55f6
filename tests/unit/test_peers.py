"""The llama.cpp peers the CPU benchmarks run: ik_llama.cpp joins where it is built."""

from pathlib import Path

import pytest

from deploy.bench import llama_build


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(llama_build, "IK", tmp_path / "ik_llama.cpp")
    monkeypatch.setattr(llama_build, "build_llama_server", lambda: tmp_path / "llama-server")
    return tmp_path


def test_ik_llama_cpp_runs_beside_llama_cpp_only_where_built(cache, capsys):
    assert [p.name for p in llama_build.peers()] == ["llama.cpp"]
    assert "make peer-ik" in capsys.readouterr().err
    binary = cache / "ik_llama.cpp" / "build" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("")
    found = llama_build.peers()
    assert [p.name for p in found] == ["llama.cpp", "ik_llama.cpp"]
    assert found[1].binary == binary and "-rtr" in found[1].flags
    assert "--no-webui" not in found[1].flags  # ik's server refuses the flag
    assert [p.name for p in llama_build.peers(ik=False)] == ["llama.cpp"]


def test_building_ik_from_a_source_that_is_not_a_repository_is_one_line_and_exit_2(cache, capsys):
    assert llama_build.main(["--ik", str(cache / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "neither a git repository nor a source folder" in err
    assert not Path(cache / "ik_llama.cpp").exists()

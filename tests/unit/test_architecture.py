"""docs/ARCHITECTURE.md true to the code: read in one sitting, every module named once in its list,
every file:function it walks through still there.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
MAX_WORDS = 2500


def _modules_on_disk() -> set[str]:
    found = set()
    for pkg in ("protos", "scheduler_service", "worker", "kernels", "deploy"):
        for p in (ROOT / pkg).rglob("*.py"):
            if p.name != "__init__.py" and "_pb2" not in p.name:
                found.add(str(p.relative_to(ROOT)))
    found |= {str(p.relative_to(ROOT)) for p in (ROOT / "protos").glob("*.proto")}
    found |= {
        str(p.relative_to(ROOT))
        for ext in ("*.c", "*.h")
        for p in (ROOT / "kernels" / "cpu").glob(ext)
    }
    found |= {
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests" / "support").glob("*.py")
        if p.name != "__init__.py"
    }
    return found


def _listed() -> list[str]:
    """The module list: one bullet a module, `path` first."""
    section = DOC.split("## Modules", 1)[1]
    return re.findall(r"^- `([^`]+)` — ", section, flags=re.M)


def _defined(path: Path, dotted: str) -> bool:
    """Whether `Name` or `Name.method` is defined at the top of the file (a class's method for the
    second).
    """
    scope = ast.parse(path.read_text()).body
    for part in dotted.split("."):
        names = {}
        for node in scope:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names[node.name] = getattr(node, "body", [])
            elif isinstance(node, ast.Assign):
                names.update({t.id: [] for t in node.targets if isinstance(t, ast.Name)})
        if part not in names:
            return False
        scope = names[part]
    return True


def test_it_reads_in_one_sitting():
    words = len(DOC.split())
    assert words <= MAX_WORDS, (
        f"{words} words; at most {MAX_WORDS}: say it once, in the code's words"
    )


def test_every_module_is_named_once_in_the_list():
    listed = _listed()
    twice = sorted({m for m in listed if listed.count(m) > 1})
    assert not twice, f"named twice: {twice}"
    on_disk = _modules_on_disk()
    assert not on_disk - set(listed), (
        f"not in docs/ARCHITECTURE.md: {sorted(on_disk - set(listed))}"
    )
    assert not set(listed) - on_disk, f"listed but gone: {sorted(set(listed) - on_disk)}"


def test_every_file_and_function_it_names_exists():
    missing = []
    for path, name in re.findall(r"`(\w+(?:/\w+)+\.py)(?::([\w.]+))?`", DOC):
        if not (ROOT / path).exists():
            missing.append(path)
        elif name and not _defined(ROOT / path, name):
            missing.append(f"{path}:{name}")
    assert not missing, "named in docs/ARCHITECTURE.md but not in the code:\n" + "\n".join(missing)

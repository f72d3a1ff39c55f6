"""The code's shape, held: layers import downward only, no import cycles, nothing private reached
across files. Read from the sources (ast), so a change that breaks the shape fails here before
review.
"""

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("protos", "kernels", "worker", "scheduler_service", "deploy")
# The layers, bottom first within each service; a module in a layer may import its own layer and
# those listed (anything else it imports is a third-party library). A service's main may import all
# of it.
SCHEDULER = ("core", "text", "runtime", "api")
WORKER = {
    "model": (),
    "weights": ("model",),
    "step": ("model",),
    "serve": ("model", "weights", "step"),
}
MAY_IMPORT = {
    "protos": {"protos"},
    "kernels": {"protos", "kernels"},
    "worker": {"protos", "kernels", "worker"},
    "scheduler_service": {"protos", "scheduler_service"},
    "deploy": set(PACKAGES),
    **{
        f"scheduler_service.{layer}": {"protos"}
        | {f"scheduler_service.{b}" for b in SCHEDULER[: i + 1]}
        for i, layer in enumerate(SCHEDULER)
    },
    **{
        f"worker.{layer}": {"protos", "kernels", f"worker.{layer}"} | {f"worker.{b}" for b in below}
        for layer, below in WORKER.items()
    },
}


def _modules() -> dict[str, ast.Module]:
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path.name.endswith("_pb2.py") or path.name.endswith("_pb2_grpc.py"):
                continue
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = ast.parse(path.read_text(), str(path))
    return found


MODULES = _modules()


def _imports(tree: ast.Module):
    """(line, module, names or None) of every import, function-level ones included."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, None
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module, [alias.name for alias in node.names]


def _project(module: str) -> bool:
    return module.split(".")[0] in PACKAGES


def _layer(module: str) -> str:
    """The layer a module belongs to: a service's sub-package where it has one, else its package."""
    parts = module.split(".")
    return ".".join(parts[:2]) if ".".join(parts[:2]) in MAY_IMPORT else parts[0]


def _allowed(importer: str, imported: str) -> bool:
    allowed = MAY_IMPORT[_layer(importer)]
    return _layer(imported) in allowed or imported.split(".")[0] in allowed


def test_layers_import_only_the_layers_below_them():
    wrong = [
        f"{name}:{line} imports {mod}"
        for name, tree in MODULES.items()
        for line, mod, names in _imports(tree)
        if _project(mod)
        for target in ([f"{mod}.{n}" for n in names or () if f"{mod}.{n}" in MODULES] or [mod])
        if not _allowed(name, target)
    ]
    assert not wrong, (
        "protos <- kernels <- worker (model <- weights, step <- serve); scheduler_service "
        "takes protos only (core <- text <- runtime <- api); deploy is on top:\n" + "\n".join(wrong)
    )


def test_the_scheduler_core_is_plain_python():
    """core/ is the policy: no event loop, no RPC, no sockets, so it is read and tested as plain
    code.
    """
    wrong = [
        f"{name}:{line} imports {mod}"
        for name, tree in MODULES.items()
        if _layer(name) == "scheduler_service.core"
        for line, mod, _ in _imports(tree)
        if mod.split(".")[0] in ("asyncio", "grpc", "zmq")
    ]
    assert not wrong, "\n".join(wrong)


def test_each_service_shows_its_layers():
    for pkg, layers in (("scheduler_service", set(SCHEDULER)), ("worker", set(WORKER))):
        folders = {p.name for p in (ROOT / pkg).iterdir() if (p / "__init__.py").exists()}
        assert folders == layers, f"{pkg}/ holds {sorted(folders)}"
        loose = {p.stem for p in (ROOT / pkg).glob("*.py")} - {"__init__", "main", "options"}
        assert not loose, (
            f"{pkg}/ top level: main.py and options.py beside the layers, not {sorted(loose)}"
        )


def _graph() -> dict[str, set[str]]:
    """Who imports whom, imports under `if TYPE_CHECKING:` included: a type named both ways is a
    cycle of the design even where no import runs.
    """
    edges = defaultdict(set)
    for name, tree in MODULES.items():
        for _, mod, names in _imports(tree):
            if mod in MODULES and mod != name:
                edges[name].add(mod)
            for n in names or ():
                if f"{mod}.{n}" in MODULES:  # `from pkg import module`
                    edges[name].add(f"{mod}.{n}")
    return edges


def test_no_module_imports_its_way_back_to_itself():
    edges = _graph()
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(path[path.index(nxt) :] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for name in sorted(MODULES):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_private_name_is_imported_from_another_module():
    wrong = [
        f"{name}:{line} from {mod} import {n}"
        for name, tree in MODULES.items()
        for line, mod, names in _imports(tree)
        if _project(mod)
        for n in names or ()
        if n.startswith("_") and not n.startswith("__")
    ]
    assert not wrong, "\n".join(wrong)


def _private_names_defined_here() -> set[str]:
    """Every _name the project defines: functions, classes, module
    globals, attributes set on self.
    """
    names = set()
    for tree in MODULES.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_object_reaches_into_another_objects_private_state():
    """`x._name` only on self or cls: another object's (or module's) private parts are its own
    business. Names the project does not define (a library's) are not this test's to judge.
    """
    ours = _private_names_defined_here()
    wrong = []
    for name, tree in MODULES.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ours:
                owner = node.value
                if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                    wrong.append(f"{name}:{node.lineno} .{node.attr}")
    assert not wrong, "\n".join(wrong)


def test_the_project_reads_as_five_packages_and_deploy_shows_the_product():
    """deploy/'s top level holds the commands a user runs and the helpers they and the tests share;
    every benchmark lives in deploy/bench/.
    """
    top = {p.stem for p in (ROOT / "deploy").glob("*.py")} - {"__init__"}
    top |= {p.parent.name for p in (ROOT / "deploy").glob("*/__main__.py")} - {"bench"}
    assert not {n for n in top if n.startswith("bench")}, "benchmarks belong in deploy/bench/"
    assert top == {
        "cli",
        "launcher",
        "supervisor",
        "fleet",
        "gateway",
        "console",
        "prepare_model",
        "loadtest",
        "processes",
        "client",
    }


def test_no_product_module_imports_the_tests():
    """tests/support is dev-only: the tests and the benchmarks (deploy/bench) use it, nothing a user
    runs.
    """
    wrong = [
        f"{name}:{line} imports {mod}"
        for name, tree in MODULES.items()
        if not name.startswith("deploy.bench")
        for line, mod, _ in _imports(tree)
        if mod.split(".")[0] == "tests"
    ]
    assert not wrong, "\n".join(wrong)


TEST_KINDS = {"unit", "kernels", "models", "e2e", "faults"}


def test_tests_are_grouped_by_kind_and_share_helpers_only_through_support():
    tests = ROOT / "tests"
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == TEST_KINDS | {"support"}
    assert not list(tests.glob("test_*.py")), "a test file belongs in the folder of its kind"
    assert not list((tests / "support").glob("test_*.py"))
    wrong = []
    for path in sorted(tests.rglob("*.py")):
        for _, mod, _ in _imports(ast.parse(path.read_text())):
            parts = mod.split(".")
            if parts[0] == "tests" and len(parts) > 1 and parts[1] != "support":
                wrong.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not wrong, "shared helpers live in tests/support:\n" + "\n".join(wrong)


def test_no_module_runs_past_400_lines():
    """A module a newcomer opens fits in one sitting; past 400 lines it is two modules."""
    files = [
        p
        for folder in PACKAGES
        for p in sorted((ROOT / folder).rglob("*.py"))
        if "_pb2" not in p.name
    ]
    sizes = {p.relative_to(ROOT): len(p.read_text().splitlines()) for p in files}
    long = [f"{p}: {n} lines" for p, n in sizes.items() if n > 400]
    assert not long, "split these:\n" + "\n".join(long)


MAX_STATEMENTS = 45


def test_no_function_runs_past_45_statements_without_saying_why():
    """A body of more than 45 statements is two functions, unless a comment on its first lines says
    why it is one (a flag table, a Triton kernel, a benchmark's script read top to bottom).
    Statements, not lines: the formatter lays one call over as many lines as it has arguments.
    """
    long = []
    for name, tree in MODULES.items():
        path = ROOT / (name.replace(".", "/") + ".py")
        path = path if path.exists() else ROOT / name.replace(".", "/") / "__init__.py"
        lines = path.read_text().splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            body = node.body[1:] if ast.get_docstring(node) and len(node.body) > 1 else node.body
            starts = {s.lineno for b in body for s in ast.walk(b) if isinstance(s, ast.stmt)}
            if len(starts) > MAX_STATEMENTS:
                head = "\n".join(lines[node.lineno - 1 : body[0].lineno])
                if "# one function:" not in head:
                    long.append(f"{name}.{node.name}: {len(starts)} statements")
    assert not long, "split these, or say why not (`# one function: ...`):\n" + "\n".join(long)


def test_environment_variables_are_read_in_one_module():
    """protos/base/env.py names every variable pagedserve reads; elsewhere the environment is only
    passed on to a child process (the benchmarks, dev tools, may read their own).
    """
    wrong = []
    for name, tree in MODULES.items():
        if name in ("protos.base.env",) or name.startswith("deploy.bench"):
            continue
        for node in ast.walk(tree):
            text = ast.unparse(node) if isinstance(node, (ast.Call, ast.Subscript)) else ""
            reads = isinstance(node, ast.Call) and text.startswith(
                ("os.environ.get(", "os.getenv(")
            )
            reads |= (
                isinstance(node, ast.Subscript)
                and text.startswith("os.environ[")
                and isinstance(node.ctx, ast.Load)
            )
            if reads:
                wrong.append(f"{name}:{node.lineno} {text}")
    assert not wrong, "read it through protos/base/env.py:\n" + "\n".join(wrong)


def test_a_module_docstring_is_its_contract():
    """A module's docstring says what it provides and what it promises, in a paragraph; how and why
    belong on the class or function they explain. A command's docstring is its --help text and may
    say more.
    """
    long = []
    for name, tree in MODULES.items():
        doc = ast.get_docstring(tree) or ""
        is_help = any(
            isinstance(node, ast.keyword)
            and node.arg == "description"
            and ast.unparse(node.value).startswith("__doc__")
            for node in ast.walk(tree)
        )
        if not is_help and len(doc.split()) > 110:
            long.append(f"{name}: {len(doc.split())} words")
    assert not long, "cut to the contract, the detail onto its class or function:\n" + "\n".join(
        long
    )

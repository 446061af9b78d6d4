"""The codebase's shape, checked statically: the linter passes, no two project modules import each
other (directly or round a longer loop), and collectives are called only where buffers get their
group's device (muloco/core/comm.py and the outer exchange)."""
from __future__ import annotations

import ast
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("muloco", "trainer", "tools", "tokenizer", "dataprep", "megatron_patches", "benchmarks")


def _modules() -> dict[str, Path]:
    """Dotted name -> file for every project module (a package is named by its __init__.py)."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool):
    """Every module named by an import statement outside `if TYPE_CHECKING:` (function-level ones too)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if is_package else module.split(".")[:-1]
                package = package[:len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            yield base, [alias.name for alias in node.names]
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for base, names in _imports(ast.parse(path.read_text(), str(path)), name, path.name == "__init__.py"):
            targets = [f"{base}.{n}" for n in names if f"{base}.{n}" in modules]  # `from pkg import submodule`
            if len(targets) < len(names) or not names:
                targets.append(base)
            # `import a.b.c` names a.b.c; the longest prefix that is a project module is the one imported.
            for target in targets:
                parts = target.split(".")
                while parts and ".".join(parts) not in modules:
                    parts.pop()
                if parts and ".".join(parts) != name:
                    edges.add(".".join(parts))
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_between_project_modules():
    graph = import_graph()
    assert "trainer.config" in graph["trainer.run"], "the walk must see the project's imports"
    assert "muloco.diloco.config" in graph["trainer.config"]
    assert cycles(graph) == []


# The floors, bottom up: a folder imports only folders below it (muloco/'s sub-packages count as
# folders of their own, its top-level modules as the floor "muloco").
FLOORS = [{"muloco.core"}, {"muloco.diloco"}, {"muloco.elastic"}, {"muloco"}, {"muloco.hook"},
          {"dataprep", "megatron_patches"}, {"tokenizer"}, {"trainer"}, {"tools"}, {"benchmarks"}]


def folder_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "muloco" and len(parts) > 2 or parts[0] == "muloco" and len(parts) == 2 and \
            (ROOT / "muloco" / parts[1]).is_dir():
        return ".".join(parts[:2])
    return parts[0]


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    folders: dict[str, set[str]] = {}
    for module, imports in graph.items():
        folders.setdefault(folder_of(module), set()).update(folder_of(i) for i in imports)
    return {folder: imports - {folder} for folder, imports in folders.items()}


def upward_imports(folders: dict[str, set[str]]) -> list[str]:
    """`a -> b` for each folder a importing a folder b that is not on a floor below a's."""
    floor = {folder: level for level, names in enumerate(FLOORS) for folder in names}
    return sorted(f"{a} -> {b}" for a, imports in folders.items() for b in imports
                  if floor.get(b, len(FLOORS)) >= floor.get(a, len(FLOORS)))


def test_the_floor_check_finds_an_import_that_runs_back_up():
    assert upward_imports({"muloco.core": {"trainer"}, "trainer": {"muloco.core"}}) == ["muloco.core -> trainer"]
    assert upward_imports({"dataprep": {"megatron_patches"}}) == ["dataprep -> megatron_patches"]


def test_every_folder_imports_only_the_floors_below_it():
    """The ground floor (muloco/core) imports none of the others; the outer loop (muloco) knows nothing
    of the Megatron trainer; dataprep, tokenizer and megatron_patches stand on the ground floor; no two
    folders need each other."""
    folders = folder_graph(import_graph())
    assert set(folders) <= set().union(*FLOORS), sorted(set(folders) - set().union(*FLOORS))
    assert "muloco.core" in folders["dataprep"] and "muloco.hook.attach" in import_graph()
    assert upward_imports(folders) == []
    assert cycles(folders) == []


@pytest.mark.launch
def test_ruff_finds_nothing():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.fail("ruff is not installed (it is in the test extras)")
    result = subprocess.run([ruff, "check", "--no-cache", *PACKAGES, "tests", "scripts", "examples"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


# Modules allowed to call torch.distributed's collectives directly: the group module, and the outer
# exchange (which takes its buffers' device from it).
COLLECTIVE_MODULES = {"muloco/core/comm.py", "muloco/diloco/wire.py"}
COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast", "barrier", "send", "recv",
               "isend", "irecv", "gather", "scatter", "reduce", "all_gather_object", "broadcast_object_list",
               "new_group"}


def test_collectives_are_called_only_through_the_group_module():
    offenders = []
    for package in ("muloco", "trainer", "tools", "megatron_patches"):
        for path in (ROOT / package).rglob("*.py"):
            relative = path.relative_to(ROOT).as_posix()
            if relative in COLLECTIVE_MODULES:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in COLLECTIVES and isinstance(node.func.value, ast.Name)
                        and node.func.value.id == "dist"):
                    offenders.append(f"{relative}:{node.lineno} dist.{node.func.attr}")
    assert offenders == [], "call muloco.core.comm instead:\n" + "\n".join(offenders)


# Where sys.path edits would hide a missing install: the installed packages, and the scripts and
# benchmarks that run on them (tests start their processes with PYTHONPATH, tests/conftest.py).
IMPORTABLE_FROM_THE_INSTALL = ("muloco", "trainer", "tools", "tokenizer", "dataprep", "megatron_patches",
                               "benchmarks", "scripts", "examples")


def _edits_sys_path(source: str) -> list[int]:
    """Lines that mutate sys.path (insert, append, extend, assignment), in Python code or in a shell
    script's `python -c`."""
    return [n for n, line in enumerate(source.splitlines(), 1)
            if any(f"sys.path.{verb}" in line for verb in ("insert", "append", "extend", "remove"))
            or "sys.path =" in line or "sys.path[" in line]


def test_the_edit_finder_finds_an_edit():
    assert _edits_sys_path("import sys\nsys.path.insert(0, 'x')\n") == [2]
    assert _edits_sys_path("python -c \"import sys; sys.path.append('tests')\"") == [1]
    assert _edits_sys_path("print(sys.path)\n") == []


def test_no_module_or_script_edits_sys_path():
    offenders = [f"{path.relative_to(ROOT)}:{line}"
                 for folder in IMPORTABLE_FROM_THE_INSTALL
                 for path in sorted((ROOT / folder).rglob("*")) if path.suffix in (".py", ".sh")
                 for line in _edits_sys_path(path.read_text())]
    assert offenders == [], "import from the installed package instead:\n" + "\n".join(offenders)


def _unresolvable_imports(path: Path, source: str | None = None) -> list[str]:
    """Absolute imports in one file that name neither the standard library, a folder or module at the
    repository root, a file beside it (a script's own folder is on its path), nor an installed package."""
    found = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for top in {name.split(".")[0] for name in names}:
            beside = [folder / candidate for folder in (ROOT, path.parent) for candidate in (top, f"{top}.py")]
            if top in sys.stdlib_module_names or any(p.exists() for p in beside):
                continue
            if importlib.util.find_spec(top) is None:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {top}")
    return found


def test_the_import_resolver_finds_a_module_from_another_folder():
    script = ROOT / "scripts" / "gpu_check.py"
    assert _unresolvable_imports(script, "from benchmarks.newton_schulz_forms import x\nimport gpu_check\n") == []
    assert _unresolvable_imports(script, "import torch\nfrom newton_schulz_forms import x\n") == [
        "scripts/gpu_check.py:2 imports newton_schulz_forms"]


def test_every_import_resolves_without_a_path_edit():
    """A script importing a benchmark by its bare name worked only while something edited sys.path."""
    offenders = [line for folder in IMPORTABLE_FROM_THE_INSTALL + ("tests",)
                 for path in sorted((ROOT / folder).rglob("*.py")) for line in _unresolvable_imports(path)]
    assert offenders == [], "import through a package the repository root provides:\n" + "\n".join(offenders)

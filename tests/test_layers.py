"""Imports point one way, and the package's import graph has no cycle.

The graph is read from the source with ``ast``, not from what happens to be imported at run time.
Between parts, every import counts wherever it stands: at module level, inside a function (it
still runs the other module's code and ties the two, only later), under ``if TYPE_CHECKING`` (a
reader still follows it up a layer), and a string constant that names a module of the package
exactly (what ``importlib`` is handed in ``drafters.load_drafter``). Between the modules of one
part, two kinds do not count, since neither runs while the package loads: a registry's lazy dispatch
to its own members by name (``models.arch_module`` builds its names from ``ARCHITECTURES`` the same
way), and a type-only back reference under ``if TYPE_CHECKING``.

Two graphs are checked: modules (``tsspec.models.llama``) and top-level parts (``tsspec/x.py`` or
the package ``tsspec/x/``). Each part sits in one layer of ``LAYERS`` and may import only from the
layers below its own: parts that share a layer are siblings and do not import each other
(``docs/ARCHITECTURE.md`` draws the same picture).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tsspec"

# bottom first
LAYERS = (
    ("errors", "interrupts"),
    ("env", "paths", "sampling_params", "validate"),  # the process environment; paths we read and write; pure values; the file checks
    ("gguf_file", "options", "sampling"),  # the file format; the speculation flags over env; the sampler
    ("tokenizer", "kernels"),
    ("gguf_weight",),  # a weight as the file stores it, for the kernels (no torch)
    ("weights",),
    ("models",),  # the target
    ("drafters", "hub"),  # the draft weights; model downloads (nothing below fetches a file)
    ("spec",),  # the algorithms and the loop
    ("chat",),  # chat templates: above the loop, below what holds a conversation
    ("generate", "display", "distill"),  # what runs the loop; the trainer beside it
    ("settings",),  # the run configuration
    ("session", "prefix_cache"),  # a run composed from it; the kept caches a conversation or a server reuses
    ("conversation", "server", "bench"),
    ("repl",),
    ("cli",),
    ("__main__",),
)
# edges that point up for now, each with the change that removes it
ALLOWED_UP: set = set()


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def part(module: str) -> str:
    """``tsspec.models.llama`` -> ``models``; the package's own ``__init__`` is ``tsspec``."""
    bits = module.split(".")
    return bits[1] if len(bits) > 1 else bits[0]


def _owner(name: str) -> str | None:
    """The package module ``name`` lives in (``tsspec.models.base.rms_norm`` -> ``tsspec.models.base``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _type_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under an ``if TYPE_CHECKING:`` (bare or as ``typing.TYPE_CHECKING``)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        test = getattr(node, "test", None)
        if isinstance(node, ast.If) and (getattr(test, "id", None) or getattr(test, "attr", None)) == "TYPE_CHECKING":
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def imports(path: Path, *, runtime_only: bool = False) -> dict[str, int]:
    """The package modules ``path`` imports -> the line of the first such import; ``runtime_only``:
    leave out the strings naming a module and the imports under ``if TYPE_CHECKING`` (see above)."""
    name = module_name(path)
    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: dict[str, int] = {}
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _type_only(tree) if runtime_only else set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            base = ".".join(pkg[: len(pkg) - node.level + 1] + [node.module or ""]) if node.level else node.module
            base = base.rstrip(".")
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif not runtime_only and isinstance(node, ast.Constant) and node.value in MODULES and "." in node.value:
            targets = [node.value]
        else:
            continue
        for t in targets:
            owner = _owner(t) if t.split(".")[0] == "tsspec" else None
            if owner and owner != name:
                found.setdefault(owner, node.lineno)
    return found


@functools.cache
def module_graph(*, runtime_only: bool = False) -> dict[str, dict[str, int]]:
    return {name: imports(path, runtime_only=runtime_only) for name, path in MODULES.items()}


def part_graph(modules: dict[str, dict[str, int]]) -> dict[str, dict[str, str]]:
    """part -> imported part -> where (``tsspec/x.py:LINE``), edges inside a part left out."""
    out: dict[str, dict[str, str]] = {}
    for mod, targets in modules.items():
        edges = out.setdefault(part(mod), {})
        for t, line in targets.items():
            if part(t) != part(mod):
                edges.setdefault(part(t), f"{MODULES[mod].relative_to(PACKAGE.parent)}:{line}")
    return out


def find_cycle(graph) -> list[str] | None:
    """One cycle of ``graph`` (node -> iterable of nodes) as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in graph.get(v, ()):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)):
                return found
        state[v] = 2
        path.pop()
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)):
            return found
    return None


def _without_allowed(parts):
    return {a: {b for b in edges if (a, b) not in ALLOWED_UP} for a, edges in parts.items()}


def test_every_part_of_the_package_has_a_layer():
    placed = [p for layer in LAYERS for p in layer]
    assert len(placed) == len(set(placed)), "a part is placed twice"
    on_disk = {part(m) for m in MODULES} - {"tsspec"}
    assert on_disk == set(placed), f"not placed: {sorted(on_disk - set(placed))}; gone: {sorted(set(placed) - on_disk)}"


def test_imports_point_down_the_layers():
    rank = {p: i for i, layer in enumerate(LAYERS) for p in layer}
    parts = part_graph(module_graph())
    bad = [f"{where}: {a} imports {b} (layer {rank[b]}, not below {a}'s {rank[a]})"
           for a, edges in parts.items() if a in rank for b, where in edges.items()
           if rank[b] >= rank[a] and (a, b) not in ALLOWED_UP]
    assert not bad, "\n".join(bad)
    stale = [e for e in ALLOWED_UP if e[1] not in parts.get(e[0], {})]
    assert not stale, f"allowed edges no longer there (delete them): {stale}"


def test_the_import_graph_has_no_cycle():
    parts = part_graph(module_graph())
    cycle = find_cycle(_without_allowed(parts))
    assert cycle is None, "parts import each other in a cycle:\n" + "\n".join(
        f"  {a} -> {b} ({parts[a][b]})" for a, b in zip(cycle, cycle[1:]))
    modules = module_graph(runtime_only=True)  # what it leaves out between parts, ``parts`` held
    allowed = {(a, b) for a in modules for b in modules[a] if (part(a), part(b)) in ALLOWED_UP}
    cycle = find_cycle({a: {b for b in t if (a, b) not in allowed} for a, t in modules.items()})
    assert cycle is None, "modules import each other in a cycle:\n" + "\n".join(
        f"  {a} -> {b} (line {modules[a][b]})" for a, b in zip(cycle, cycle[1:]))


def test_the_scan_sees_every_kind_of_import():
    """The checker itself: relative imports at any depth, inside functions, importlib's names."""
    assert {"tsspec.validate", "tsspec.gguf_file", "tsspec.models.base"} <= set(imports(PACKAGE / "models" / "llama.py"))
    assert "tsspec.spec.registry" in imports(PACKAGE / "settings.py")  # imported inside speculator_names()
    assert "tsspec.drafters.dflash" in imports(PACKAGE / "drafters" / "__init__.py")  # an importlib target
    assert "tsspec.sampling" in imports(PACKAGE / "spec" / "protocols.py")  # under TYPE_CHECKING
    assert "tsspec.sampling" not in imports(PACKAGE / "spec" / "protocols.py", runtime_only=True)
    assert "tsspec.models.qwen35" in imports(PACKAGE / "models" / "qwen3next.py")  # `from .qwen35 import`


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) in (
        ["a", "b", "c", "a"], ["b", "c", "a", "b"], ["c", "a", "b", "c"])
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None

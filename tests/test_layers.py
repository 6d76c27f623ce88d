"""Imports point one way: cli -> session -> spec -> (models, drafters) -> weights/gguf.

Every ``import`` in the package, module level or inside a function, is read from the source; a
module may import only from its own layer or the layers below it (``docs/ARCHITECTURE.md``)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tsspec"

# what each part of the package must not import (the layers above it)
FORBIDDEN = {
    "models": {"spec", "drafters", "session", "cli", "bench", "settings", "generate", "display", "chat", "hub", "distill"},
    "drafters": {"spec", "session", "cli", "bench", "settings", "generate", "display", "chat", "distill"},
    "spec": {"session", "cli", "bench", "settings", "generate", "display", "chat", "distill"},
    "weights": {"models", "drafters", "spec", "session", "cli", "bench"},
    "gguf_file": {"models", "drafters", "spec", "session", "cli", "bench", "weights"},
    "kernels": {"models", "drafters", "spec", "session", "cli", "bench", "weights"},
    "session": {"cli"},
    # the trainer loads a trunk and writes a drafter file; nothing below it knows it exists
    "distill": {"cli", "session", "bench", "generate", "display", "server"},
}


def imported_parts(path: Path) -> set[str]:
    """The top-level ``tsspec`` parts a module imports (``tsspec.spec.loop`` -> ``spec``)."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("").parts  # ("tsspec", "models", "base")
    pkg = list(rel[:-1]) if path.name != "__init__.py" else list(rel[:-1])
    parts = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
                mods = [name] if node.module else [f"{name}.{a.name}" for a in node.names]
            else:
                mods = [node.module or ""]
        elif isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        else:
            continue
        for m in mods:
            bits = m.split(".")
            if bits[0] == "tsspec" and len(bits) > 1:
                parts.add(bits[1])
    return parts


def test_imports_point_one_way():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        part = rel.parts[0].removesuffix(".py")
        forbidden = FORBIDDEN.get(part, set())
        for got in sorted(imported_parts(path) & forbidden):
            bad.append(f"tsspec/{rel} imports tsspec.{got}")
    assert not bad, "\n".join(bad)


def test_the_scan_sees_relative_and_nested_imports(tmp_path):
    """The checker itself: a relative import two levels up, inside a function, is found."""
    f = PACKAGE / "models" / "base.py"
    assert "weights" in imported_parts(f) and "gguf_file" in imported_parts(f)
    assert "kernels" in imported_parts(PACKAGE / "models" / "runners.py")  # imported inside fused_blocks()

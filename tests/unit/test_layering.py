"""The import rules of ../shared/ARCHITECTURE.md, checked on the source (parsed, never imported):
imports only point down, and `model/` knows nothing of processes, meshes or the training loop.
Lazy imports inside functions count as much as module-level ones."""

from __future__ import annotations

import ast
from pathlib import Path

import depthscale

PACKAGE = Path(depthscale.__file__).resolve().parent

FORBIDDEN = {
    "model": ("parallel", "train", "observe", "cli", "data", "interop", "resilience"),
    "kernels": ("model", "parallel", "train", "observe", "cli", "data", "interop", "resilience"),
    "data": ("model", "kernels", "parallel", "train", "observe", "cli", "interop", "resilience"),
    "parallel": ("train", "observe", "cli", "interop", "resilience"),
    "observe": ("train", "cli", "resilience"),
    "train": ("cli",),
    "resilience": ("model", "kernels", "data", "cli", "interop"),
    "config": (
        "model",
        "kernels",
        "data",
        "parallel",
        "train",
        "observe",
        "cli",
        "interop",
        "plan",
        "resilience",
        "evaluation",
    ),
    "shape": (
        "config",
        "model",
        "kernels",
        "data",
        "parallel",
        "train",
        "observe",
        "cli",
        "interop",
        "resilience",
        "plan",
        "evaluation",
    ),
    "plan": ("model", "kernels", "data", "train", "observe", "cli", "interop", "resilience"),
}
"""Layer (subpackage of depthscale) → subpackages it must not import."""

LEAVES = (
    "depthscale.observe.spans",
    "depthscale.observe.startup",
    "depthscale.observe.device_time",
)
"""Modules any layer may import: they import nothing from depthscale (checked below). The span
recorder is one, so that the pipeline, the ring and the collectives record where they work;
`device_time` another, so that their step statistics time device work."""


def imported_modules(source: str, module: str) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `source`, the file of `module`
    (dotted, e.g. "depthscale.model.layers"), relative imports resolved."""
    found = []
    package = module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                name = f"{base}.{node.module}" if node.module else base
            else:
                name = node.module or ""
            found.append((node.lineno, name))
            # `from depthscale import parallel`: the names may be subpackages
            found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]
    return found


def _leaf_import(line: int, name: str, found: list[tuple[int, str]]) -> bool:
    """`name` is a leaf, or the package a leaf is imported from on this line
    (`from depthscale.observe import spans`)."""
    return name.startswith(LEAVES) or any(
        ln == line and other.startswith(LEAVES) and other.startswith(name + ".")
        for ln, other in found
    )


def violations(source: str, module: str) -> list[str]:
    """The forbidden imports of one module, as 'module:line imports name (layer → layer)'."""
    parts = module.split(".")
    layer = parts[1] if len(parts) > 2 else None
    banned = FORBIDDEN.get(layer, ())
    bad: dict[int, str] = {}  # one per import statement
    found = imported_modules(source, module)
    for line, name in found:
        target = name.split(".")
        if _leaf_import(line, name, found):
            continue
        if target[0] == "depthscale" and len(target) > 1 and target[1] in banned:
            bad.setdefault(
                line, f"{module}:{line} imports {name} ({layer}/ must not import {target[1]}/)"
            )
    return list(bad.values())


def _modules() -> dict[str, Path]:
    return {
        ".".join(("depthscale", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(
            ".__init__"
        ): path
        for path in sorted(PACKAGE.rglob("*.py"))
    }


def test_imports_only_point_down():
    bad = [v for m, path in _modules().items() for v in violations(path.read_text(), m)]
    assert not bad, "layering violations:\n" + "\n".join(bad)


def test_subpackages_form_no_import_cycle():
    """Edges between depthscale's subpackages (lazy imports included) have no cycle."""
    modules = _modules()
    edges: dict[str, set[str]] = {}
    for module, path in modules.items():
        parts = module.split(".")
        if len(parts) < 3:
            continue  # top-level modules (config, errors, the `python -m depthscale` entry) are not layers
        found = imported_modules(path.read_text(), module)
        for line, name in found:
            target = name.split(".")
            if _leaf_import(line, name, found):
                continue
            crosses = target[0] == "depthscale" and len(target) > 2 and target[1] != parts[1]
            if crosses and f"depthscale.{target[1]}" in modules:
                edges.setdefault(parts[1], set()).add(target[1])

    def cycle_from(node: str, stack: list[str]) -> list[str] | None:
        if node in stack:
            return stack[stack.index(node) :] + [node]
        for nxt in sorted(edges.get(node, ())):
            found = cycle_from(nxt, [*stack, node])
            if found:
                return found
        return None

    for start in sorted(edges):
        cycle = cycle_from(start, [])
        assert cycle is None, "import cycle between subpackages: " + " → ".join(cycle)


KNOWN_MODULE_CYCLES = (
    {"depthscale.parallel.context_parallel", "depthscale.parallel.sequence_layout"},
)
"""Modules that import each other (lazily, at least one way), tolerated until split: this list
should only shrink."""


def _runtime_imports(source: str, module: str) -> list[tuple[int, str]]:
    """imported_modules, less those under `if TYPE_CHECKING:` (annotations only: never run)."""
    typing_only = {
        inner.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING")
        for stmt in node.body
        for inner in ast.walk(stmt)
        if isinstance(inner, ast.Import | ast.ImportFrom)
    }
    return [(ln, name) for ln, name in imported_modules(source, module) if ln not in typing_only]


def test_modules_form_no_import_cycle():
    """No two modules import each other, directly or through others (lazy imports included),
    but the KNOWN_MODULE_CYCLES: a cycle is two modules that cannot be read, tested or imported
    apart (checkpoint.py and save_process.py were one)."""
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        for _, name in _runtime_imports(path.read_text(), module):
            parts = name.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()  # `from depthscale.train.manifest import step_dir`: the module
            target = ".".join(parts)
            if target not in ("", module, "depthscale"):
                edges[module].add(target)

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        return seen

    reach = {m: reachable(m) for m in modules}
    cycles = {
        frozenset({m} | {o for o in reach[m] if m in reach[o]}) for m in modules if m in reach[m]
    }
    unknown = [sorted(c) for c in cycles if not any(c <= known for known in KNOWN_MODULE_CYCLES)]
    assert not unknown, f"modules importing each other: {unknown}"


def test_the_checker_catches_forbidden_imports():
    """The rules fire on module-level, lazy, relative and `from depthscale import x` forms."""
    source = (
        "import torch\n"
        "from depthscale.parallel.mesh import ParallelDims\n"
        "def f():\n"
        "    from ..train import trainer\n"
        "    from depthscale import observe\n"
        "from .layers import RMSNorm\n"
    )
    bad = violations(source, "depthscale.model.transformer")
    assert len(bad) == 3, bad
    assert bad[0] == (
        "depthscale.model.transformer:2 imports depthscale.parallel.mesh "
        "(model/ must not import parallel/)"
    )
    assert "imports depthscale.train " in bad[1] and "imports depthscale.observe " in bad[2]
    assert violations(source, "depthscale.train.trainer") == []


def test_leaves_import_nothing_from_depthscale():
    modules = _modules()
    for leaf in LEAVES:
        found = [n for _, n in imported_modules(modules[leaf].read_text(), leaf)]
        assert not [n for n in found if n.startswith("depthscale")], (leaf, found)

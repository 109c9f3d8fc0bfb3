"""The import graph runs one way: HTTP -> wiring -> engines -> models -> kernels, with `index/`
and `migrations/` as libraries below the service (vLLM's entrypoints over its engine, TEI's
router over its backend). Read from the source with `ast`, function-level imports included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("embedserve", "index", "kernels", "migrations")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str) -> set[str]:
    """Every module of ours that `path` imports (absolute names, relative imports resolved)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            # `from pkg import mod` imports pkg.mod when that is a module of ours, else names in pkg
            subs = [f"{prefix}.{a.name}" for a in node.names]
            names = [n for n in subs if n in MODULES]
            if len(names) < len(subs):
                names.append(prefix)
        else:
            continue
        found.update(n for n in names if n.split(".")[0] in PACKAGES)
    return found


MODULES = {_module_name(path): path for pkg in PACKAGES for path in (ROOT / pkg).rglob("*.py")}


def _graph() -> dict[str, set[str]]:
    return {name: {m for m in _imports(path, name) if m in MODULES and m != name} for name, path in MODULES.items()}


GRAPH = _graph()


def _violations(importer_prefixes: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(f"{mod} imports {dep}" for mod, deps in GRAPH.items() for dep in deps
                  if mod.startswith(importer_prefixes) and dep.startswith(forbidden))


def test_the_graph_was_read():
    assert "embedserve.api.app" in GRAPH and "embedserve.api.state" in GRAPH["embedserve.api.app"]
    assert "index.core" in GRAPH["index.store"]


def test_engines_models_and_kernels_never_import_the_http_layer():
    assert _violations(("embedserve.engine", "embedserve.models", "kernels"), ("embedserve.api",)) == []


def test_engines_and_models_never_import_the_wiring_or_the_cli():
    assert _violations(("embedserve.engine", "embedserve.models", "embedserve.api"),
                       ("embedserve.serve", "embedserve.cli")) == []


def test_libraries_never_import_the_service_layers():
    assert _violations(("index", "migrations"), ("embedserve.api", "embedserve.engine")) == []


def test_index_and_kernels_import_nothing_from_embedserve():
    assert _violations(("index", "kernels"), ("embedserve",)) == []


def test_ray_is_imported_only_by_the_ray_engine_and_only_inside_it():
    """Ray is an optional extra: one module uses it, lazily, so `import embedserve` never needs it."""
    users = set()
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(m == "ray" or m.startswith("ray.") for m in mods):
                users.add(name)
                assert node not in tree.body, f"{name} imports ray at module level"
    assert users == {"migrations.ray_engine"}


def test_no_two_modules_import_each_other():
    pairs = sorted({tuple(sorted((a, b))) for a, deps in GRAPH.items() for b in deps if a in GRAPH.get(b, ())})
    assert pairs == []


def test_the_checks_can_fail():
    """The reader sees a cycle and a layer violation when there is one (here, made up)."""
    GRAPH["embedserve.engine.fake"] = {"embedserve.api.app"}
    GRAPH["embedserve.api.app"] = GRAPH["embedserve.api.app"] | {"embedserve.engine.fake"}
    try:
        assert _violations(("embedserve.engine",), ("embedserve.api",)) == ["embedserve.engine.fake imports embedserve.api.app"]
    finally:
        del GRAPH["embedserve.engine.fake"]
        GRAPH["embedserve.api.app"] = GRAPH["embedserve.api.app"] - {"embedserve.engine.fake"}

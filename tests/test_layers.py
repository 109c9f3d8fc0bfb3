"""The import graph runs one way: HTTP -> wiring -> engines -> models -> kernels, with `index/`
and `migrations/` as libraries below the service (vLLM's entrypoints over its engine, TEI's
router over its backend), and the benchmark studies (`embedserve/studies/`) beside it: nothing
imports them, and they and the load generator use only public names of the product. Read from
the source with `ast`, function-level imports included; and no module of these packages is
over ~400 lines."""

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


def _package(path: Path, module: str) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _from_module(node: ast.ImportFrom, package: str) -> str:
    """The absolute name of the module a `from ... import` reads (relative levels resolved)."""
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(path: Path, module: str) -> set[str]:
    """Every module of ours that `path` imports (absolute names, relative imports resolved)."""
    package = _package(path, module)
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            prefix = _from_module(node, package)
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


STUDIES = "embedserve.studies"
# what uses the product from outside, as a user's script would: only its public names
OUTSIDERS = (STUDIES, "embedserve.bench")


def _private(name: str) -> bool:
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in name.split("."))


def _private_uses(tree: ast.AST, module: str, package: str, own: str) -> list[str]:
    """The private (`_`-prefixed) names of ours outside `own` that `tree` imports (`from m import
    _x`, `import m._x`), or reaches as an attribute of anything but `self` and torch (`eng._ids`)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"{module} imports {a.name}" for a in node.names
                      if a.name.split(".")[0] in PACKAGES and not a.name.startswith(own) and _private(a.name)]
        elif isinstance(node, ast.ImportFrom):
            src = _from_module(node, package)
            if src.split(".")[0] in PACKAGES and not src.startswith(own):
                found += [f"{module} imports {src}.{a.name}" for a in node.names if _private(f"{src}.{a.name}")]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if not (isinstance(root, ast.Name) and root.id in ("self", "cls", "torch")):
                found.append(f"{module} line {node.lineno} reaches .{node.attr}")
    return found


def test_the_product_never_imports_the_studies():
    assert sorted(f"{mod} imports {dep}" for mod, deps in GRAPH.items() for dep in deps
                  if not mod.startswith(STUDIES) and dep.startswith(STUDIES)) == []


def test_studies_and_the_load_generator_use_only_public_names_of_the_product():
    found = []
    for name, path in MODULES.items():
        own = next((o for o in OUTSIDERS if name.startswith(o)), None)
        if own:
            found += _private_uses(ast.parse(path.read_text(), str(path)), name, _package(path, name), own)
    assert found == []


MAX_LINES = 420     # "small enough to read in one sitting": ~400, grown by adding a file, not a branch


def test_no_module_is_over_420_lines():
    sizes = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    assert sorted(f"{name}: {n} lines" for name, n in sizes.items() if n > MAX_LINES) == []


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
    """The reader sees a cycle, a layer violation and a private name when there is one (here, made up)."""
    made_up = ast.parse("from embedserve.engine.decode_engine import DecodeEngine, _Detok\n"
                        "from ..precision import _cpuinfo\nfrom . import _helper\nimport kernels._common\n"
                        "eng._ids, self._own, torch._int_mm\n")
    assert _private_uses(made_up, "embedserve.studies.x", "embedserve.studies", STUDIES) == [
        "embedserve.studies.x imports embedserve.engine.decode_engine._Detok",
        "embedserve.studies.x imports embedserve.precision._cpuinfo",
        "embedserve.studies.x imports kernels._common",
        "embedserve.studies.x line 5 reaches ._ids"]
    GRAPH["embedserve.engine.fake"] = {"embedserve.api.app"}
    GRAPH["embedserve.api.app"] = GRAPH["embedserve.api.app"] | {"embedserve.engine.fake"}
    try:
        assert _violations(("embedserve.engine",), ("embedserve.api",)) == ["embedserve.engine.fake imports embedserve.api.app"]
    finally:
        del GRAPH["embedserve.engine.fake"]
        GRAPH["embedserve.api.app"] = GRAPH["embedserve.api.app"] - {"embedserve.engine.fake"}

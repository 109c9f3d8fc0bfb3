"""The installed environment: our top-level packages (`embedserve`, `kernels`, `index`,
`migrations`, the layout's names) are ours alone. A dependency that brings a package of the same
import name (transformers 5.25 requires Hugging Face's `kernels`) would shadow ours in an editable
install and overwrite its files in a wheel install; this catches it the day a pin lets one in."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = ("embedserve", "kernels", "index", "migrations")


def test_no_other_installed_distribution_provides_our_top_level_packages():
    owners = md.packages_distributions()
    clashes = {name: sorted(set(owners[name]) - {"embedserve"}) for name in OURS if name in owners}
    clashes = {name: dists for name, dists in clashes.items() if dists}
    assert not clashes, (f"installed distributions that provide our import names: {clashes}; pin the "
                         f"dependency that pulls them in (pyproject.toml) or uninstall them")


def test_the_console_script_imports_our_packages_from_any_directory(tmp_path):
    # outside the checkout (as `embedserve serve` runs) the installed mapping decides, not the cwd
    code = ("import kernels, index, migrations, embedserve; "
            "print('\\n'.join(m.__path__[0] for m in (kernels, index, migrations, embedserve)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    paths = [Path(p).resolve() for p in out.stdout.split()]
    assert paths == [ROOT / name for name in ("kernels", "index", "migrations", "embedserve")]
    from kernels import check_kv_cache_dtype  # what `embedserve serve` imports first
    assert callable(check_kv_cache_dtype)

"""Benchmark studies, run by hand as tools (`python -m embedserve.studies.<name>`): `make bench`'s
side-by-side run (compare), profiles, the CPU paths side by side, the decoder and reindex studies.

They use only public names of the product, and the product never imports them
(tests/test_layers.py); the load generator they drive, `embedserve bench`, is in embedserve.bench."""

import json
from pathlib import Path


def write_results(out: Path, res: dict, md: str) -> None:
    """A study's result: `res` as JSON at `out`, its markdown beside it (`.md`), the markdown printed."""
    out.write_text(json.dumps(res, indent=2) + "\n")
    out.with_suffix(".md").write_text(md + "\n")
    print(md)

"""Every file in examples/ runs as written against the real server (default models)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_example_runs(name, server):
    env = dict(os.environ, EMBEDSERVE_URL=server)
    r = subprocess.run([sys.executable, str(EXAMPLES / name)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip(), "an example should show what it did"


def test_model_swap_script(tmp_path):
    """examples/model_swap.sh: build with MiniLM, reindex to e5, search, roll back, history."""
    bin_dir = Path(sys.executable).parent
    env = dict(os.environ, EMBEDSERVE=str(bin_dir / "embedserve"), PATH=f"{bin_dir}:{os.environ['PATH']}")
    r = subprocess.run(["bash", str(EXAMPLES / "model_swap.sh")], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert '"swapped": true' in out and '"kind": "rollback"' in out and "yangtze" in out.split("== multilingual")[1]


def test_examples_are_all_covered():
    assert {p.name for p in EXAMPLES.iterdir()} >= {"quickstart.py", "ingest_jsonl.py", "rag_answer.py",
                                                    "openai_sdk.py", "langchain_rag.py", "model_swap.sh"}

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


def test_examples_are_all_covered():
    assert {p.name for p in EXAMPLES.glob("*.py")} >= {"quickstart.py", "ingest_jsonl.py", "rag_answer.py",
                                                       "openai_sdk.py", "langchain_rag.py"}

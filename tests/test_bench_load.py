"""`embedserve bench embed|generate`: the arrival process, the percentile math, the accounting
against a stub server with known delays and failures, and one short run on the real server."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import numpy as np
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from helpers import free_port
from embedserve.bench import report, workload
from embedserve.cli import main as cli_main

EMBED_DELAY = 0.05      # s the stub takes per embeddings request
FIRST_DELAY = 0.08      # s before the stub's first completion chunk
CHUNK_GAP = 0.03        # s between its later chunks
STUB_MODEL = "stub-model"


# ----------------------------------------------------------------------------- arrivals
@pytest.mark.parametrize("burstiness, cv", [(1.0, 1.0), (0.25, 2.0), (4.0, 0.5)])
def test_inter_arrivals_have_mean_one_over_rate_and_gamma_cv(burstiness, cv):
    gaps = workload.inter_arrival_times(20_000, 5.0, burstiness, np.random.default_rng(0))
    assert gaps.shape == (20_000,) and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.2, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)      # CV = 1/sqrt(shape)


def test_infinite_rate_sends_everything_at_once_and_offsets_start_at_zero():
    assert (workload.inter_arrival_times(50, float("inf"), 1.0, np.random.default_rng(0)) == 0).all()
    assert workload.arrival_offsets(np.array([0.5, 0.25, 1.0])).tolist() == [0.0, 0.5, 0.75]
    a = workload.inter_arrival_times(10, 3.0, 1.0, np.random.default_rng(7))
    b = workload.inter_arrival_times(10, 3.0, 1.0, np.random.default_rng(7))
    assert (a == b).all()                                                # seeded: the same schedule


# ----------------------------------------------------------------------------- percentiles
def test_percentiles_interpolate_linearly_between_closest_ranks():
    # position (n-1)*q/100 in the sorted values
    assert report.percentile([4, 1, 3, 2], 50) == 2.5                    # 1.5 → 2 + 0.5
    assert report.percentile([4, 1, 3, 2], 90) == pytest.approx(3.7)     # 2.7 → 3 + 0.7
    assert report.percentile([4, 1, 3, 2], 99) == pytest.approx(3.97)    # 2.97
    xs = [15, 20, 35, 40, 50]
    assert report.percentile(xs, 50) == 35                               # 2.0 exactly
    assert report.percentile(xs, 90) == pytest.approx(46.0)              # 3.6 → 40 + 0.6*10
    assert report.percentile(xs, 99) == pytest.approx(49.6)              # 3.96
    assert report.percentile([7], 99) == 7 and report.percentile(xs, 100) == 50 and report.percentile(xs, 0) == 15
    ys = np.random.default_rng(1).exponential(size=37).tolist()
    for q in (50, 90, 99):                                               # numpy's default method
        assert report.percentile(ys, q) == pytest.approx(np.percentile(ys, q, method="linear"))
    stats = report.latency_stats([0.001, 0.002, 0.003, 0.004])
    assert stats["mean"] == pytest.approx(2.5) and stats["p90"] == pytest.approx(3.7)   # milliseconds
    assert report.latency_stats([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


# ----------------------------------------------------------------------------- datasets
def test_random_workload_is_seeded_sized_and_separate_from_warmup():
    cfg = workload.LoadConfig(kind="embed", model="m", num_requests=30, warmup=3, input_len=40, range_ratio=0.5,
                              batch_size=2, seed=3)
    w = workload.build_workload(cfg)
    assert len(w.measured) == 30 and len(w.warmup) == 3
    assert all(set(b) == {"model", "input"} and len(b["input"]) == 2 for b in w.measured)
    texts = [t for b in w.measured + w.warmup + [w.probe] for t in b["input"]]
    assert len(set(texts)) == len(texts)                                 # nothing repeats
    assert any("\u4e00" <= ch <= "\u9fff" for t in texts for ch in t)    # some Chinese words
    budget = [sum(workload.ZH_COST if not w_.isascii() else 1 for w_ in t.split()) for t in texts]
    assert 20 - workload.ZH_COST < min(budget) and max(budget) <= 60     # [40*(1-r), 40*(1+r)]
    assert workload.build_workload(cfg).measured == w.measured           # the same seed, the same texts
    g = workload.build_workload(workload.LoadConfig(kind="generate", model="m", num_requests=5, output_len=8,
                                                    ignore_eos=True))
    assert g.measured[0]["max_tokens"] == 8 and g.measured[0]["ignore_eos"] is True
    assert g.measured[0]["stream_options"] == {"include_usage": True} and g.measured[0]["temperature"] == 0.0


def test_jsonl_lines_set_prompt_and_output_len(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "output_len": 3}\n\n{"text": "b"}\n')
    w = workload.build_workload(workload.LoadConfig(kind="generate", model="m", dataset="jsonl",
                                                    dataset_path=str(path), output_len=9, stream=False))
    assert [(b["prompt"], b["max_tokens"]) for b in w.measured] == [("a", 3), ("b", 9)]
    assert "stream_options" not in w.measured[0] and "ignore_eos" not in w.measured[0]


# ----------------------------------------------------------------------------- the stub server
class Stub:
    """An OpenAI-shaped server with known delays; inputs that contain `fail-429` / `fail-500`
    are refused with that status and `slow` ones take 2 s. Records the peak requests in flight."""

    def __init__(self):
        self.in_flight = self.peak = 0
        self.bodies: list[dict] = []

    def reset(self):
        deadline = time.time() + 10
        while self.in_flight and time.time() < deadline:     # a timed-out request still sleeping
            time.sleep(0.05)
        self.peak, self.bodies = 0, []

    def _enter(self):
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)

    @staticmethod
    def _refusal(body: dict, text: str):
        if body.get("model") != STUB_MODEL:
            return JSONResponse({"error": {"message": f"model {body.get('model')!r} not found"}}, 404)
        for status in (429, 500):
            if f"fail-{status}" in text:
                return JSONResponse({"error": {"message": f"stub {status}", "type": "x"}}, status)
        return None

    async def embeddings(self, request):
        body = await request.json()
        self.bodies.append(body)
        texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
        self._enter()
        try:
            await asyncio.sleep(2.0 if any("slow" in t for t in texts) else EMBED_DELAY)
            if (refused := self._refusal(body, " ".join(texts))) is not None:
                return refused
            return JSONResponse({"object": "list", "model": STUB_MODEL,
                                 "data": [{"object": "embedding", "index": i, "embedding": [0.0] * 4}
                                          for i in range(len(texts))],
                                 "usage": {"prompt_tokens": 10 * len(texts), "total_tokens": 10 * len(texts)}})
        finally:
            self.in_flight -= 1

    async def completions(self, request):
        body = await request.json()
        self.bodies.append(body)
        if (refused := self._refusal(body, body["prompt"])) is not None:
            return refused
        n = body["max_tokens"]
        usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n}
        if not body.get("stream"):
            self._enter()
            try:
                await asyncio.sleep(FIRST_DELAY)
                return JSONResponse({"object": "text_completion", "choices": [{"index": 0, "text": "x" * n}],
                                     "usage": usage})
            finally:
                self.in_flight -= 1

        async def events():
            self._enter()
            try:
                await asyncio.sleep(FIRST_DELAY)
                for i in range(n):
                    if i:
                        await asyncio.sleep(CHUNK_GAP)
                    chunk = {"choices": [{"index": 0, "text": f" t{i}",
                                          "finish_reason": "length" if i == n - 1 else None}]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                if (body.get("stream_options") or {}).get("include_usage"):
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                self.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def stub():
    s = Stub()
    app = Starlette(routes=[Route("/v1/embeddings", s.embeddings, methods=["POST"]),
                            Route("/v1/completions", s.completions, methods=["POST"])])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    s.base = f"http://127.0.0.1:{port}"
    yield s
    server.should_exit = True
    thread.join(10)


def _bench(stub, kind, *flags, tmp_path):
    """Run the CLI on the stub; (exit code, the result file's content)."""
    stub.reset()
    out = tmp_path / f"{kind}.json"
    rc = cli_main(["bench", kind, "--base-url", stub.base, "--model", STUB_MODEL, "--out", str(out), *flags])
    return rc, (json.loads(out.read_text()) if out.exists() else None)


def test_failures_are_counted_by_status_and_tokens_come_from_usage(stub, tmp_path, capsys):
    lines = []
    for i in range(1, 22):
        tag = "slow" if i == 21 else "fail-429" if i % 5 == 0 else "fail-500" if i % 7 == 0 else "ok"
        lines.append(json.dumps({"text": f"text {i} {tag}"}))
    data = tmp_path / "texts.jsonl"
    data.write_text("\n".join(lines) + "\n")
    rc, res = _bench(stub, "embed", "--dataset", "jsonl", "--dataset-path", str(data), "--timeout", "0.5",
                     "--save-requests", tmp_path=tmp_path)
    assert rc == 0
    m = res["runs"][0]["metrics"]
    assert m["completed"] == 14 and m["failed"] == 7
    assert m["failed_by_status"] == {"429": 4, "500": 2, "connection": 1}
    assert m["first_error_by_status"]["429"] == "stub 429"
    assert m["input_tokens"] == 140                                      # 10 per text, from usage
    assert m["input_token_throughput"] == pytest.approx(140 / m["duration_s"])
    assert m["request_throughput"] == pytest.approx(14 / m["duration_s"])
    assert m["e2e_latency_ms"]["p50"] >= EMBED_DELAY * 1000 * 0.9
    assert len(res["runs"][0]["requests"]) == 21 and res["machine"]["cores"] >= 1 and res["machine"]["date"]
    assert res["config"]["request_rate"] == "inf" and res["config"]["endpoint"] == "/v1/embeddings"
    table = capsys.readouterr().out
    assert "429:4 500:2 connection:1" in table and "e2e p99 (ms)" in table


def test_max_concurrency_caps_requests_in_flight(stub, tmp_path):
    rc, res = _bench(stub, "embed", "--num-requests", "20", "--input-len", "8", "--max-concurrency", "3",
                     tmp_path=tmp_path)
    assert rc == 0 and res["runs"][0]["metrics"]["completed"] == 20
    assert stub.peak == 3
    rc, _ = _bench(stub, "embed", "--num-requests", "20", "--input-len", "8", tmp_path=tmp_path)
    assert rc == 0 and stub.peak > 3                                     # uncapped, rate inf: all at once


def test_request_rate_spaces_the_arrivals(stub, tmp_path):
    rc, res = _bench(stub, "embed", "--num-requests", "6", "--input-len", "4", "--request-rate", "20",
                     "--burstiness", "1000", "--save-requests", tmp_path=tmp_path)   # nearly constant gaps
    starts = [r["start"] for r in res["runs"][0]["requests"]]
    assert rc == 0 and starts[-1] == pytest.approx(0.25, abs=0.1)       # 5 gaps of ~0.05 s


def test_streamed_generation_times_first_token_and_chunks(stub, tmp_path):
    rc, res = _bench(stub, "generate", "--num-requests", "8", "--input-len", "16", "--output-len", "5",
                     "--ignore-eos", "--warmup", "2", tmp_path=tmp_path)
    assert rc == 0
    m = res["runs"][0]["metrics"]
    assert m["completed"] == 8 and m["failed"] == 0
    assert m["output_tokens"] == 40 and m["input_tokens"] == 56         # usage: 5 and 7 per request
    assert m["output_token_throughput"] == pytest.approx(40 / m["duration_s"])
    # loose upper bounds: these tests share two busy cores
    assert FIRST_DELAY * 1000 * 0.9 <= m["ttft_ms"]["p50"] <= (FIRST_DELAY + 0.3) * 1000
    assert CHUNK_GAP * 1000 * 0.8 <= m["itl_ms"]["p50"] <= (CHUNK_GAP + 0.1) * 1000
    assert CHUNK_GAP * 1000 * 0.8 <= m["tpot_ms"]["mean"] <= (CHUNK_GAP + 0.1) * 1000
    assert m["e2e_latency_ms"]["p50"] >= (FIRST_DELAY + 4 * CHUNK_GAP) * 1000 * 0.9
    assert len(stub.bodies) == 1 + 2 + 8                                 # probe, warm-up, measured
    assert all(b["ignore_eos"] is True and b["stream_options"] == {"include_usage": True} for b in stub.bodies)


def test_unstreamed_generation_reads_usage_and_has_no_ttft(stub, tmp_path):
    rc, res = _bench(stub, "generate", "--num-requests", "3", "--input-len", "8", "--output-len", "4",
                     "--no-stream", tmp_path=tmp_path)
    m = res["runs"][0]["metrics"]
    assert rc == 0 and m["completed"] == 3 and m["output_tokens"] == 12
    assert m["ttft_ms"]["p50"] is None and m["itl_ms"]["p50"] is None
    assert all(b["stream"] is False for b in stub.bodies)


def test_sweep_runs_each_value_and_plots_latency_against_throughput(stub, tmp_path):
    png = tmp_path / "sweep.png"
    rc, res = _bench(stub, "generate", "--num-requests", "4", "--input-len", "8", "--output-len", "3",
                     "--sweep", "concurrency=1,4", "--plot", str(png), tmp_path=tmp_path)
    assert rc == 0
    assert res["sweep"] == {"key": "concurrency", "values": [1, 4]}
    assert [r["label"] for r in res["runs"]] == ["concurrency=1", "concurrency=4"]
    assert [r["max_concurrency"] for r in res["runs"]] == [1, 4]
    assert all(r["metrics"]["completed"] == 4 for r in res["runs"])
    # one at a time takes about four times as long as four at once
    assert res["runs"][0]["metrics"]["duration_s"] > 2 * res["runs"][1]["metrics"]["duration_s"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


@pytest.mark.parametrize("flags, says", [
    (["--request-rate", "-1"], "--request-rate"),
    (["--request-rate", "nan"], "--request-rate"),
    (["--num-requests", "0"], "--num-requests"),
    (["--burstiness", "0"], "--burstiness"),
    (["--max-concurrency", "0"], "--max-concurrency"),
    (["--range-ratio", "1"], "--range-ratio"),
    (["--dataset", "jsonl", "--dataset-path", "/nonexistent/d.jsonl"], "no such file"),
    (["--dataset", "jsonl"], "--dataset-path"),
    (["--sweep", "speed=1,2"], "--sweep"),
    (["--sweep", "rate=1,-2"], "--sweep rate"),
    (["--request-rate", "fast"], "invalid float value"),
    (["--no-such-flag"], "unrecognized arguments"),
    (["--model", "other-model"], "HTTP 404"),
    (["--out", "/nonexistent/dir/r.json"], "--out"),
])
def test_a_bad_flag_is_one_line_and_exit_2(stub, flags, says, capsys):
    rc = cli_main(["bench", "embed", "--base-url", stub.base, "--model", STUB_MODEL, "--num-requests", "2", *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("embedserve bench: error:") and says in err[0]


def test_an_unreachable_server_is_one_line_and_exit_2(capsys):
    rc = cli_main(["bench", "generate", "--base-url", f"http://127.0.0.1:{free_port()}", "--model", "m"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "cannot reach" in err[0]


def test_bench_routes_to_the_load_generator_and_points_at_the_comparison(capsys):
    """`make bench`'s comparison is a study beside the product, not a subcommand: `bench` names it."""
    from embedserve.studies import compare
    with pytest.raises(SystemExit):
        compare.main(["--help"])
    assert "make bench" in capsys.readouterr().out
    assert cli_main(["bench", "compare", "--help"]) == 2 and "embedserve.studies.compare" in capsys.readouterr().err
    assert cli_main(["bench"]) == 2 and "choose `embed`" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the real server
@pytest.mark.slow
def test_short_runs_on_the_real_server(server, tmp_path, capsys):
    out = tmp_path / "embed.json"
    rc = cli_main(["bench", "embed", "--base-url", server, "--model", "multilingual-e5-small",
                   "--num-requests", "20", "--input-len", "32", "--range-ratio", "0.5", "--max-concurrency", "4",
                   "--warmup", "2", "--out", str(out)])
    m = json.loads(out.read_text())["runs"][0]["metrics"]
    assert rc == 0 and m["completed"] == 20 and m["failed"] == 0
    assert m["request_throughput"] > 0 and m["input_tokens"] > 20 * 10
    out = tmp_path / "gen.json"
    rc = cli_main(["bench", "generate", "--base-url", server, "--model", "SmolLM2-135M-Instruct",
                   "--num-requests", "6", "--input-len", "16", "--output-len", "8", "--ignore-eos",
                   "--out", str(out)])
    m = json.loads(out.read_text())["runs"][0]["metrics"]
    assert rc == 0 and m["completed"] == 6 and m["failed"] == 0
    assert m["output_tokens"] == 6 * 8 and m["output_token_throughput"] > 0
    assert m["ttft_ms"]["p50"] > 0 and m["itl_ms"]["p50"] > 0 and m["tpot_ms"]["p50"] > 0
    print(capsys.readouterr().out)

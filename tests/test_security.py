"""Keys, rate limit, CORS and privacy, as a deployer meets them: several keys at once and a key
file rotated under a running server, a per-key token bucket (429 + `Retry-After` for that key
only), CORS headers only when asked for, the API docs behind the key, and no request text or key
in the server's log at the default log level."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from embedserve.api.auth import KeyRing, read_key_file
from embedserve.api.ratelimit import RateLimiter, TokenBucket
from embedserve.config import ServerConfig, config_fields
from embedserve.errors import ConfigError
from helpers import server_env, spawn_server, stop_process

EMBED = "all-MiniLM-L6-v2"
CHAT = "SmolLM2-135M-Instruct"
KEY_A, KEY_B, KEY_RATE = "sk-alpha-4b1d9e", "sk-bravo-77c3a0", "sk-rate-0e5f12"
KEY_FILE_OLD, KEY_FILE_NEW = "sk-file-old-9a8b7c", "sk-file-new-1c2d3e"
ALL_KEYS = (KEY_A, KEY_B, KEY_RATE, KEY_FILE_OLD, KEY_FILE_NEW)
RATE, BURST = 1.0, 8
ORIGIN = "https://app.example"
CANARY = "CANARY-7f3a9c"


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


# ---------------------------------------------------------------- no server: the parts alone

def test_token_bucket_refills_at_the_rate_up_to_the_burst():
    b = TokenBucket(rate=2.0, burst=3, tokens=3.0, updated=0.0)
    assert [b.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]         # the burst goes at once
    assert b.take(0.0) == pytest.approx(0.5)                           # one token every 1/rate s
    assert b.take(0.25) == pytest.approx(0.25)                         # half refilled, a quarter s to go
    assert b.take(0.5) == 0.0
    assert b.take(100.0) == 0.0 and b.tokens == pytest.approx(2.0)    # idle: capped at the burst, less one
    assert [b.take(100.0) for _ in range(2)] == [0.0, 0.0] and b.take(100.0) > 0


def test_rate_limiter_retry_after_is_whole_seconds_rounded_up():
    clock = Clock()
    lim = RateLimiter(rate=0.25, burst=1, clock=clock)
    assert lim.check("k") == 0
    assert lim.check("k") == 4                    # a whole token at 0.25 a second
    clock.now += 1.0
    assert lim.check("k") == 3                    # 0.25 there, 0.75 to go
    clock.now += 1.1
    assert lim.check("k") == 2                    # 0.525 there: 1.9 s to go, rounded up
    clock.now += 1.9
    assert lim.check("k") == 0
    assert lim.check("other") == 0                # callers have buckets of their own


def test_rate_limiter_forgets_the_least_recent_caller_past_its_bound():
    clock = Clock()
    lim = RateLimiter(rate=0.001, burst=1, max_callers=2, clock=clock)
    assert lim.check("a") == 0 and lim.check("b") == 0
    assert lim.check("a") > 0                     # a used again: b is now the least recent
    assert lim.check("c") == 0                    # b forgotten
    assert lim.check("a") > 0 and lim.check("c") > 0
    assert lim.check("b") == 0                    # a forgotten caller starts with a full bucket


def test_key_file_format_and_refusals_never_show_a_key(tmp_path):
    f = tmp_path / "keys"
    f.write_text(f"# rotated 2024-05\n\n  {KEY_A}  \n#{KEY_B}\n{KEY_RATE}\n")
    assert read_key_file(str(f)) == [KEY_A, KEY_RATE]
    for text in ("", "\n# only a comment\n  \n"):
        f.write_text(text)
        with pytest.raises(ConfigError, match="holds no key"):
            read_key_file(str(f))
    with pytest.raises(ConfigError, match="cannot be read"):
        read_key_file(str(tmp_path / "missing"))
    f.write_text(f"{KEY_A} {KEY_B}\n")
    with pytest.raises(ConfigError, match="line 1") as exc:
        read_key_file(str(f))
    assert KEY_A not in str(exc.value) and KEY_B not in str(exc.value)
    for bad in (f"{KEY_B}\tx", f"{KEY_B}-ключ"):
        with pytest.raises(ConfigError, match="value 2") as exc:
            ServerConfig.of(model=EMBED, api_key=f"{KEY_A},{bad}")
        assert KEY_B not in str(exc.value)
    with pytest.raises(ConfigError, match="cannot be read"):
        KeyRing(ServerConfig.of(model=EMBED, api_key_file=str(tmp_path / "missing")))


@pytest.mark.server
def test_serve_refuses_to_start_on_a_key_file_it_cannot_use(tmp_path):
    empty = tmp_path / "keys"
    empty.write_text("# nothing yet\n")
    for path, why in ((tmp_path / "missing", "cannot be read"), (empty, "holds no key")):
        srv = spawn_server("--model", EMBED, "--generate-model", "none", "--index-dir", str(tmp_path / "ix"),
                           "--api-key-file", str(path), clean_env=True, ready=False)
        assert srv.proc.wait(300) == 2
        out = srv.output()
        assert f"--api-key-file {path}" in out and why in out and "Traceback" not in out, out[-2000:]


def test_config_repr_hides_keys_and_rate_flags_are_checked():
    cfg = ServerConfig.of(model=EMBED, api_key=f"{KEY_A},{KEY_B}", rate_limit=2.5)
    assert cfg.http.api_keys == [KEY_A, KEY_B]
    assert KEY_A not in repr(cfg) and KEY_B not in repr(cfg) and "api_key_file" in repr(cfg)
    assert cfg.http.rate_burst == 3                    # default burst: the rate, rounded up
    assert ServerConfig.of(model=EMBED, api_key=" , ").http.api_key is None
    with pytest.raises(ConfigError, match="--rate-burst needs --rate-limit"):
        ServerConfig.of(model=EMBED, rate_burst=4)
    for bad in ({"rate_limit": 0.0}, {"rate_limit": 1.0, "rate_burst": 0}):
        with pytest.raises(ConfigError, match="--rate-"):
            ServerConfig.of(model=EMBED, **bad)


def test_repeated_flags_add_keys_and_origins(monkeypatch):
    from embedserve.cli import build_parser
    from embedserve.cli.serve import config_from_args

    for f in config_fields():
        monkeypatch.delenv("EMBEDSERVE_" + f.name.upper(), raising=False)
    args = build_parser().parse_args(["serve", "--model", EMBED, "--api-key", KEY_A, "--api-key", KEY_B,
                                      "--allowed-origins", ORIGIN, "--allowed-origins", "http://localhost:3000",
                                      "--rate-limit", "0.5", "--rate-burst", "4"])
    cfg = config_from_args(args)
    assert cfg.http.api_keys == [KEY_A, KEY_B] and cfg.http.origins == [ORIGIN, "http://localhost:3000"]
    assert (cfg.http.rate_limit, cfg.http.rate_burst) == (0.5, 4)
    cfg = config_from_args(build_parser().parse_args(["serve", "--model", EMBED]))
    assert cfg.http.api_keys == [] and cfg.http.origins == [] and cfg.http.rate_limit is None
    monkeypatch.setenv("EMBEDSERVE_API_KEY", f"{KEY_A},{KEY_B}")
    parser = build_parser()
    assert config_from_args(parser.parse_args(["serve"])).http.api_keys == [KEY_A, KEY_B]
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    help_text = serve.format_help()
    assert "--api-key-file" in help_text and KEY_A not in help_text      # --help never shows a key


def test_every_key_is_compared_whichever_matches(tmp_path, monkeypatch):
    """No early exit: a token equal to the first key is still compared with all of them."""
    import hmac

    from embedserve.api import auth

    f = tmp_path / "keys"
    f.write_text(KEY_FILE_OLD + "\n")
    ring = KeyRing(ServerConfig.of(model=EMBED, api_key=f"{KEY_A},{KEY_B}", api_key_file=str(f)))
    calls, real = [], hmac.compare_digest

    def counting(a, b):
        calls.append(1)
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    for token, expect_match in ((KEY_A, True), (KEY_FILE_OLD, True), ("sk-wrong", False), ("", False)):
        calls.clear()
        assert (ring.match(token) is not None) == expect_match
        assert len(calls) == 3, token
    assert ring.match(KEY_A) != ring.match(KEY_B)         # each key its own identity (rate limit)


def test_key_file_is_reread_at_most_once_a_second_and_a_broken_file_keeps_the_keys(tmp_path):
    clock, f = Clock(), tmp_path / "keys"
    f.write_text(KEY_FILE_OLD + "\n")
    ring = KeyRing(ServerConfig.of(model=EMBED, api_key_file=str(f)), clock=clock)
    assert ring.enabled and ring.match(KEY_FILE_OLD) and not ring.match(KEY_FILE_NEW)
    f.write_text(KEY_FILE_NEW + "\n")
    clock.now += 0.5
    assert ring.match(KEY_FILE_OLD) and not ring.match(KEY_FILE_NEW)     # not looked at yet
    clock.now += 0.6
    assert ring.match(KEY_FILE_NEW) and not ring.match(KEY_FILE_OLD)
    f.write_text("")                                  # an editor mid-save, or a mistake
    clock.now += 1.1
    assert ring.match(KEY_FILE_NEW)
    f.unlink()
    clock.now += 1.1
    assert ring.match(KEY_FILE_NEW)
    f.write_text(f"{KEY_A}\n")
    clock.now += 1.1
    assert ring.match(KEY_A) and not ring.match(KEY_FILE_NEW)


def test_rate_limit_by_client_address_without_keys(tmp_path):
    """No key configured: one bucket per client IP; /health and /ready never limited."""
    from embedserve.api.middleware import GuardMiddleware
    from embedserve.api.state import AppState

    async def ok(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    state = AppState(config=ServerConfig.of(model=EMBED, rate_limit=0.5, rate_burst=2, index_dir=str(tmp_path)))
    guard = GuardMiddleware(ok, state)

    async def run():
        def client(ip):
            return httpx.AsyncClient(transport=httpx.ASGITransport(app=guard, client=(ip, 5000)),
                                     base_url="http://test")
        async with client("10.0.0.1") as one, client("10.0.0.2") as two:
            first = [(await one.get("/v1/models")).status_code for _ in range(2)]
            refused = await one.post("/v1/embeddings", json={"input": "x"})
            other = (await two.get("/v1/models")).status_code
            probes = [(await one.get(p)).status_code for p in ("/health", "/ready") * 10]
            return first, refused, other, probes

    first, refused, other, probes = asyncio.run(run())
    assert first == [200, 200] and other == 200 and set(probes) == {200}
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "2"      # 1 token at 0.5/s
    err = refused.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "rate_limited" and "client address" in err["message"]


# ---------------------------------------------------------------- real servers

def _env() -> dict:
    """The environment without any EMBEDSERVE_<FIELD> a developer may have set (the defaults are
    under test), two torch threads."""
    return server_env(clean=True)


def _start(args: list[str], log: Path):
    """`embedserve serve ARGS` on a free port, output into `log`, the developer's EMBEDSERVE_*
    settings left out (the defaults are under test); (process, base URL) once ready."""
    srv = spawn_server(*args, log=log, clean_env=True)
    return srv.proc, srv.base


_stop = stop_process


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """MiniLM only, three keys on the command line, one in a key file, a rate limit, two origins;
    the default log level. Yields (base URL, key file, log file)."""
    d = tmp_path_factory.mktemp("guarded")
    key_file, log = d / "keys", d / "server.log"
    key_file.write_text(f"# the file's keys\n{KEY_FILE_OLD}\n")
    proc, base = _start(["--model", EMBED, "--dtype", "float32", "--generate-model", "none",
                         "--index-dir", str(d / "ix"), "--api-key", KEY_A, "--api-key", f"{KEY_B},{KEY_RATE}",
                         "--api-key-file", str(key_file), "--rate-limit", str(RATE), "--rate-burst", str(BURST),
                         "--allowed-origins", ORIGIN, "--allowed-origins", "http://localhost:3000"], log)
    try:
        yield base, key_file, log
    finally:
        _stop(proc)


def test_every_configured_key_works_and_no_other(guarded):
    base, _, _ = guarded
    with httpx.Client(base_url=base, timeout=60) as c:
        for key in (KEY_A, KEY_B):
            r = c.post("/v1/embeddings", json={"input": "hello"}, headers=_bearer(key))
            assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384
        assert c.get("/v1/models", headers={"authorization": f"bearer {KEY_A}"}).status_code == 200
        assert c.get("/v1/models", headers=_bearer(KEY_FILE_OLD)).status_code == 200    # from the file
        for headers in ({}, _bearer("sk-charlie-000000"), _bearer(KEY_A + "x"), _bearer(KEY_A[:-1]),
                        _bearer(f"{KEY_A},{KEY_B}"), {"Authorization": KEY_A}, {"X-Api-Key": KEY_A}):
            r = c.get("/v1/models", headers=headers)
            assert r.status_code == 401, headers
            err = r.json()["error"]
            assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
            assert not any(k in r.text for k in ALL_KEYS)
        models = c.get("/v1/models", headers=_bearer(KEY_B)).text
        assert EMBED in models and not any(k in models for k in ALL_KEYS)


def test_key_file_rotation_without_restart(guarded):
    base, key_file, _ = guarded
    with httpx.Client(base_url=base, timeout=30) as c:
        assert c.get("/v1/models", headers=_bearer(KEY_FILE_NEW)).status_code == 401
        tmp = key_file.with_suffix(".tmp")
        tmp.write_text(f"# rotated\n{KEY_FILE_NEW}\n")
        os.replace(tmp, key_file)
        t0, status = time.monotonic(), None
        while time.monotonic() - t0 < 5:
            status = c.get("/v1/models", headers=_bearer(KEY_FILE_NEW)).status_code
            if status != 401:
                break
            time.sleep(0.1)
        took = time.monotonic() - t0
        assert status == 200 and took < 2.5, (status, took)
        assert c.get("/v1/models", headers=_bearer(KEY_FILE_OLD)).status_code == 401
        assert c.get("/v1/models", headers=_bearer(KEY_A)).status_code == 200    # --api-key keys stay


def test_rate_limit_is_per_key_with_retry_after(guarded):
    base, _, _ = guarded
    with httpx.Client(base_url=base, timeout=30) as c:
        t0, codes, refused = time.monotonic(), [], None
        while refused is None and len(codes) < BURST + 10:     # two routes, one bucket per key
            r = (c.get("/v1/models", headers=_bearer(KEY_RATE)) if len(codes) % 2 else
                 c.post("/v1/embeddings", json={"input": "x"}, headers=_bearer(KEY_RATE)))
            codes.append(r.status_code)
            refused = r if r.status_code == 429 else None
        elapsed = time.monotonic() - t0
        # the burst at once, then no more than what refilled while they were sent
        assert refused is not None, codes
        assert codes[:BURST] == [200] * BURST and codes.count(200) <= BURST + math.ceil(elapsed * RATE), codes
        retry = refused.headers["Retry-After"]
        assert retry.isdigit() and 1 <= int(retry) <= math.ceil(1 / RATE)
        err = refused.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "rate_limited"
        assert KEY_RATE not in refused.text
        # the other keys are not held back, nor are the probes (with or without the key)
        assert c.get("/v1/models", headers=_bearer(KEY_B)).status_code == 200
        assert c.post("/v1/embeddings", json={"input": "x"}, headers=_bearer(KEY_A)).status_code == 200
        for _ in range(10):
            assert c.get("/health", headers=_bearer(KEY_RATE)).status_code == 200
            assert c.get("/ready").status_code == 200
        time.sleep(int(retry) + 0.1)
        assert c.get("/v1/models", headers=_bearer(KEY_RATE)).status_code == 200


def test_cors_headers_for_the_allowed_origins_only(guarded):
    base, _, _ = guarded
    with httpx.Client(base_url=base, timeout=30) as c:
        pre = c.options("/v1/embeddings", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                                                   "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN  # no key needed
        assert "POST" in pre.headers["access-control-allow-methods"]
        r = c.get("/v1/models", headers={"Origin": "http://localhost:3000", **_bearer(KEY_A)})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        denied = c.get("/v1/models", headers={"Origin": "https://evil.example", **_bearer(KEY_A)})
        assert "access-control-allow-origin" not in denied.headers
        pre = c.options("/v1/embeddings", headers={"Origin": "https://evil.example",
                                                   "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in pre.headers
        # a 401 is readable by the allowed page too (so it can tell the user why)
        r = c.get("/v1/models", headers={"Origin": ORIGIN})
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ORIGIN


def test_docs_and_openapi_need_the_key(guarded):
    base, _, _ = guarded
    with httpx.Client(base_url=base, timeout=30) as c:
        for path in ("/docs", "/redoc", "/openapi.json", "/metrics"):
            assert c.get(path).status_code == 401, path
            assert c.get(path, headers=_bearer(KEY_B)).status_code == 200, path
        assert "/v1/embeddings" in c.get("/openapi.json", headers=_bearer(KEY_B)).json()["paths"]
        assert c.get("/health").status_code == 200 and c.get("/ready").status_code == 200


def test_every_documented_operation_needs_the_key(guarded):
    """Each path and method of the OpenAPI document, without a key and with a wrong one: 401 in
    OpenAI's envelope before any body is read (the body sent is garbage); only /health and /ready
    answer without a key."""
    base, _, _ = guarded
    with httpx.Client(base_url=base, timeout=30) as c:
        doc = c.get("/openapi.json", headers=_bearer(KEY_A)).json()
        seen = 0
        for path, ops in doc["paths"].items():
            url = path.replace("{name}", "kb").replace("{doc_id}", "d1")
            assert "{" not in url, path                     # a new path parameter: fill it in above
            for method in ops:
                for headers in ({}, _bearer("sk-wrong-0000000000")):
                    r = c.request(method.upper(), url, headers=headers, content=b"\xff not json")
                    if path in ("/health", "/ready"):
                        assert r.status_code != 401, (method, path)
                        continue
                    assert r.status_code == 401, (method, path, r.status_code, r.text[:200])
                    assert r.json()["error"]["type"] == "authentication_error", (method, path)
                    seen += 1
        assert seen >= 2 * 12, seen                        # every route of the API, not a handful


def test_keys_never_reach_the_log(guarded):
    base, _, log = guarded
    with httpx.Client(base_url=base, timeout=30) as c:
        c.get("/v1/models", headers=_bearer(KEY_A))
        c.get("/v1/models", headers=_bearer(KEY_A + "-almost"))
        c.post("/v1/embeddings", content=b"{not json", headers=_bearer(KEY_B))
    time.sleep(0.3)
    text = log.read_text()
    assert "Uvicorn running" in text or "Application startup complete" in text, text[-2000:]  # the capture works
    assert not any(k in text for k in ALL_KEYS), [k for k in ALL_KEYS if k in text]


# ---------------------------------------------------------------- privacy: a canary in every kind of request

_clients = threading.local()


def _thread_client(base: str) -> httpx.Client:
    """One keep-alive client per pool thread (a new httpx.Client costs ~30 ms of CPU for its TLS
    context, which the 1,000-request tests would spend in this process, not in the server)."""
    c = getattr(_clients, "c", None)
    if c is None or str(c.base_url).rstrip("/") != base:
        c = _clients.c = httpx.Client(base_url=base, timeout=120)
    return c


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Embedding and generation (SmolLM2), one key, no CORS flag, default log level.
    Yields (base URL, log file, process)."""
    d = tmp_path_factory.mktemp("plain")
    log = d / "server.log"
    proc, base = _start(["--model", EMBED, "--dtype", "float32", "--index-dir", str(d / "ix"),
                         "--api-key", KEY_A, "--max-model-len", "512", "--kv-cache-memory", "50000000",
                         "--max-body-bytes", "65536"], log)
    try:
        yield base, log, proc
    finally:
        _stop(proc)


def test_no_cors_headers_without_allowed_origins(plain):
    base, _, _ = plain
    with httpx.Client(base_url=base, timeout=30) as c:
        pre = c.options("/v1/embeddings", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
        r = c.post("/v1/embeddings", json={"input": "x"}, headers={"Origin": ORIGIN, **_bearer(KEY_A)})
        assert r.status_code == 200
        for resp in (pre, r):
            assert not any(h.startswith("access-control-") for h in resp.headers), dict(resp.headers)


def _canary_requests(i: int) -> list[tuple[str, str, str, dict, object]]:
    """(kind, method, path, headers, json or raw body) of one round of requests, each carrying the
    canary in its text; every kind of route, valid and invalid."""
    key, text = _bearer(KEY_A), f"{CANARY} round {i}: the quick brown fox"
    long_text = f"{CANARY} " * 600
    return [
        ("embed", "POST", "/v1/embeddings", key, {"input": [text, text + " again"], "model": EMBED}),
        ("embed bad type", "POST", "/v1/embeddings", key, {"input": [text, 5]}),
        ("embed bad field", "POST", "/v1/embeddings", key, {"input": text, "encoding_format": CANARY}),
        ("embed unknown model", "POST", "/v1/embeddings", key, {"input": text, "model": CANARY}),
        ("embed too long", "POST", "/v1/embeddings", key, {"input": long_text}),
        ("body too large", "POST", "/v1/embeddings", key, {"input": CANARY * 6000}),
        ("bad json", "POST", "/v1/embeddings", key, f'{{"input": "{CANARY}'.encode()),
        ("wrong key", "POST", "/v1/embeddings", _bearer(CANARY), {"input": text}),
        ("query string", "POST", f"/v1/embeddings?note={CANARY}", key, {"input": "x"}),
        ("completion", "POST", "/v1/completions", key, {"model": CHAT, "prompt": text, "max_tokens": 2}),
        ("chat", "POST", "/v1/chat/completions", key,
         {"model": CHAT, "max_tokens": 2, "stream": i % 2 == 0,
          "messages": [{"role": "system", "content": CANARY}, {"role": "user", "content": text}]}),
        ("chat bad", "POST", "/v1/chat/completions", key, {"model": CHAT, "messages": CANARY}),
        ("chat too long", "POST", "/v1/chat/completions", key,
         {"model": CHAT, "max_tokens": 2, "messages": [{"role": "user", "content": long_text}]}),
        ("upsert", "POST", "/v1/indexes/privacy/documents", key,
         {"documents": [{"id": f"{CANARY}-{i}", "text": text, "metadata": {"note": CANARY}}]}),
        ("upsert bad", "POST", "/v1/indexes/privacy/documents", key, {"documents": [{"id": CANARY, "text": 5}]}),
        ("upsert unknown index", "POST", f"/v1/indexes/{CANARY}/documents", key,
         {"documents": [{"id": "d", "text": text}]}),
        ("search", "POST", "/v1/search", key, {"index": "privacy", "query": text, "top_k": 2,
                                               "filter": {"note": CANARY}}),
        ("search bad", "POST", "/v1/search", key, {"index": "privacy", "query": text, "mode": CANARY}),
        ("unknown route", "GET", f"/v1/{CANARY}", key, None),
    ]


_EXPECTED = {"embed": 200, "embed bad type": 400, "embed bad field": 400, "embed unknown model": 404,
             "embed too long": 400, "body too large": 413, "bad json": 400, "wrong key": 401,
             "query string": 200, "completion": 200, "chat": 200, "chat bad": 400, "chat too long": 400,
             "upsert": 200, "upsert bad": 400, "upsert unknown index": 404, "search": 200,
             "search bad": 400, "unknown route": 404}


def test_metrics_series_stay_bounded_by_the_routes_whatever_the_paths(plain):
    """1,000 requests to distinct index names, document ids and made-up paths, with and without a
    key: `embedserve_requests_total` gains at most one series per (route template or `unmatched`,
    status), and no label holds a path a caller chose."""
    from prometheus_client.parser import text_string_to_metric_families

    base, _, _ = plain
    paths = [p for i in range(250) for p in (f"/v1/indexes/ix-{i}/documents", f"/v1/indexes/ix-{i}",
                                              f"/v1/made-up-{i}", f"/not-a-route-{i}/x")]

    def send(i_path):
        i, path = i_path
        headers = _bearer(KEY_A) if i % 2 else {}
        return _thread_client(base).get(path, headers=headers).status_code

    with ThreadPoolExecutor(4) as pool:
        statuses = list(pool.map(send, enumerate(paths)))
    assert len(statuses) == 1000 and 500 not in statuses and {401, 404} <= set(statuses), set(statuses)
    with httpx.Client(base_url=base, timeout=30) as c:
        # every route the API documents, plus FastAPI's own pages
        app_routes = set(c.get("/openapi.json", headers=_bearer(KEY_A)).json()["paths"]) | {
            "/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"}
        text = c.get("/metrics", headers=_bearer(KEY_A)).text
    series = [s for fam in text_string_to_metric_families(text) if fam.name == "embedserve_requests"
              for s in fam.samples if s.name == "embedserve_requests_total"]
    routes = {s.labels["route"] for s in series}
    codes = {s.labels["status"] for s in series}
    assert len(series) <= (len(app_routes) + 1) * len(codes), (len(series), sorted(routes))
    assert routes <= app_routes | {"unmatched"}, sorted(routes - app_routes)
    assert {"/v1/indexes/{name}/documents", "/v1/indexes/{name}", "unmatched"} <= routes, sorted(routes)
    assert not [r for r in routes if "ix-" in r or "made-up" in r or "not-a-route" in r]


def test_canary_in_every_kind_of_request_never_reaches_the_log(plain):
    """40 rounds of every kind of request, 4 at a time, with a canary in its text: the answers are what each
    kind gets, and the canary is nowhere in the server's stdout/stderr at the default log level.
    Index names a user creates are logged (an operator's identifiers, not request text), so the
    canary is not used as one here; in a path it is (routes are logged by their template)."""
    base, log, proc = plain
    with httpx.Client(base_url=base, timeout=120) as c:
        assert c.post("/v1/indexes", json={"name": "privacy"}, headers=_bearer(KEY_A)).status_code == 201

    def send(req):
        kind, method, path, headers, body = req
        c = _thread_client(base)
        if isinstance(body, bytes):
            r = c.request(method, path, content=body, headers=headers)
        else:
            r = c.request(method, path, json=body, headers=headers)
        return kind, r.status_code, r.text

    reqs = [r for i in range(40) for r in _canary_requests(i)]
    assert set(_EXPECTED) == {r[0] for r in reqs}
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(send, reqs))
    wrong = [(k, s, t[:200]) for k, s, t in results if s != _EXPECTED[k]]
    assert not wrong, wrong[:5]
    with httpx.Client(base_url=base, timeout=30) as c:
        hits = c.post("/v1/search", json={"index": "privacy", "query": CANARY, "top_k": 3},
                      headers=_bearer(KEY_A)).json()["data"]
        assert len(hits) == 3 and CANARY in hits[0]["text"]           # the text went in, and comes back
    with httpx.Client(base_url=base, timeout=30) as c:
        metrics = c.get("/metrics", headers=_bearer(KEY_A)).text
    assert "embedserve_requests_total" in metrics
    for needle in (CANARY, CANARY.lower(), "7f3a9c"):
        assert needle not in metrics, [line for line in metrics.splitlines() if needle in line][:5]
    _stop(proc)                                                       # shutdown logs count too
    text = log.read_text()
    assert "Application startup complete" in text and "generation model" in text, text[-2000:]
    for needle in (CANARY, CANARY.lower(), "7f3a9c", KEY_A):
        assert needle not in text, [line for line in text.splitlines() if needle in line][:5]


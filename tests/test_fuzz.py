"""Schemathesis against our own OpenAPI document: every operation, valid and (where it has a
body) invalid cases, 200 examples each, on the real models behind a real uvicorn (MiniLM;
SmolLM2 with a 48-token context so a valid generation stays short). No 5xx, every status,
content type and body as documented, the server alive after."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import schemathesis
import uvicorn
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import positive_data_acceptance

from helpers import BERT_RERANKER_DIR, free_port, make_decode_engine
from embedserve.config import ServerConfig
from embedserve.engine.generator import Generator
from embedserve.serve import build_app


@pytest.fixture(scope="module")
def fuzz_server(smollm2, smollm2_dir, minilm_model, tmp_path_factory):
    """The app on a real uvicorn server in a thread (one lifespan for the whole module): MiniLM,
    the tiny BERT cross-encoder (the rerank routes' default), SmolLM2."""
    from embedserve.models.cross_encoder import CrossEncoderModel
    reranker = CrossEncoderModel(BERT_RERANKER_DIR, name="tiny-bert-reranker", dtype="float32")
    # the int8 weight-only decoder (its own gated path; ~3x the fp32 decode on the AVX2 kind):
    # this checks the HTTP contract, not numerics, and most of the module's time is generation
    from embedserve.models.llama import LlamaModel
    int8 = LlamaModel.from_dir(smollm2_dir, linear_weights="int8")
    eng = make_decode_engine((int8, smollm2[1]), num_blocks=64, max_model_len=48, max_num_seqs=8)   # short answers
    gen = Generator(name="SmolLM2-135M-Instruct", engine=eng, tokenizer=smollm2[1])
    cfg = ServerConfig.of(model="all-MiniLM-L6-v2", index_dir=str(tmp_path_factory.mktemp("fuzz-indexes")),
                       max_client_batch_size=64)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(cfg, model=[minilm_model, reranker], generator=gen), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    httpx.post(base + "/v1/indexes", json={"name": "fuzz"}).raise_for_status()
    httpx.post(base + "/v1/indexes/fuzz/documents",
               json={"documents": [{"id": "a", "text": "The Danube."}]}).raise_for_status()
    yield base
    server.should_exit = True
    thread.join(30)


def _cases() -> list:
    """(method, path, mode) of every operation, read from the document (an app without models);
    invalid cases wherever there is something to spoil: a body, or an index name in the path
    (documented with its pattern)."""
    doc = build_app(ServerConfig.of(generate_model="none")).openapi()
    out = []
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            modes = [GenerationMode.POSITIVE]
            if "requestBody" in op or op.get("parameters"):
                modes.append(GenerationMode.NEGATIVE)
            out += [pytest.param(method.upper(), path, m, id=f"{method.upper()} {path} {m.value}") for m in modes]
    return out


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server + "/openapi.json")


@pytest.mark.parametrize("method,path,mode", _cases())
def test_every_operation_conforms_and_never_5xx(api_schema, method, path, mode):
    operation = api_schema[path][method]
    calls = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    def run(case):
        # every check but "schema-valid data is accepted": the server rightly refuses some of it
        # for what a schema cannot say (token counts, the vocabulary, the context length, an
        # index that does not exist, a blank text) — always with a 4xx naming the field
        calls.append(case.call_and_validate(excluded_checks=[positive_data_acceptance]).status_code)
    run()
    print(method, path, mode.value, len(calls), "calls, statuses", sorted(set(calls)))
    has_input = "{" in path or method == "POST"
    assert len(calls) >= (200 if has_input else 1), len(calls)


def test_the_server_is_alive_after_the_fuzzing(fuzz_server):
    assert httpx.get(fuzz_server + "/health").status_code == 200
    r = httpx.post(fuzz_server + "/v1/embeddings", json={"input": "still here"})
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 384


def _documented(schemas: dict, ref: str) -> bool:
    """The schema `ref` names an object with properties and required fields, a list of such, or
    a choice among such (/rerank answers Cohere's object or TEI's list, by the body it got)."""
    schema = schemas[ref.rsplit("/", 1)[1]]
    if "anyOf" in schema:
        return all(_documented(schemas, branch["$ref"]) for branch in schema["anyOf"])
    if schema.get("type") == "array":
        return _documented(schemas, schema["items"]["$ref"])
    return bool(schema["properties"] and schema["required"])


def test_every_success_body_is_documented():
    """Each operation's success response names its body's schema (so the conformance check
    above validates real bodies, not `{}`), and no status the server never sends (FastAPI's 422:
    a request it refuses gets our 400) is documented."""
    doc = build_app(ServerConfig.of(generate_model="none")).openapi()
    schemas = doc["components"]["schemas"]
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            ok = [code for code in op["responses"] if code.startswith("2")]
            assert len(ok) == 1, (method, path, ok)
            content = op["responses"][ok[0]]["content"]
            assert "422" not in op["responses"], (method, path)
            for media, body in content.items():
                schema = body["schema"]
                if media == "application/json":
                    assert _documented(schemas, schema["$ref"]), (method, path, schema)
                elif media == "text/event-stream":
                    chunk = schema["properties"]["data"]["oneOf"][1]["contentSchema"]["$ref"].rsplit("/", 1)[1]
                    assert chunk.endswith("Chunk") and schemas[chunk]["required"], (method, path, chunk)
                else:
                    assert schema["type"] == "string", (method, path, media)
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert set(chat) == {"application/json", "text/event-stream"}
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert doc["paths"]["/v1/indexes"]["post"]["responses"]["201"]

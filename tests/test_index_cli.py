"""`embedserve index ...` end to end (the model loader patched to the session's MiniLM), on both
backends: `--index-dir` (local files) and `--index-url` (a real PostgreSQL)."""

from __future__ import annotations

import json

import pytest

from embedserve.cli import index as index_cli
from embedserve.cli import main
from embedserve.embedders import ModelEmbedder


@pytest.fixture(params=["local", pytest.param("postgres", marks=pytest.mark.postgres)])
def cli(request, tmp_path, minilm_model, monkeypatch, capsys):
    loaded = []

    def fake_load(name, dtype, sparse_model=None, prompts=None):
        loaded.append(name)
        assert sparse_model is None                  # these indexes pair no sparse model
        return ModelEmbedder(minilm_model, prompts=prompts)
    monkeypatch.setattr(index_cli, "_load_embedder", fake_load)

    where = ["--index-dir", str(tmp_path / "ix")]
    if request.param == "postgres":
        where += ["--index-url", request.getfixturevalue("pg_url")]

    def run(*argv):
        rc = main(["index", argv[0], *where, *argv[1:]])
        out = capsys.readouterr()
        return rc, out.out, out.err
    run.loaded = loaded
    return run


def test_create_add_search_verify_delete(cli, tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text("\n".join(json.dumps(d) for d in [
        {"id": "a", "text": "Paris is the capital of France.", "metadata": {"lang": "en"}},
        {"id": "b", "text": "Berlin is the capital of Germany.", "metadata": {"lang": "en"}},
        {"id": "c", "text": "Le chat dort sur le canapé.", "metadata": {"lang": "fr"}}]) + "\n")
    note = tmp_path / "note.txt"
    note.write_text("FAISS searches dense vectors quickly.")

    rc, out, _ = cli("create", "kb", "--model", "all-MiniLM-L6-v2")
    assert rc == 0 and json.loads(out)["model"] == "all-MiniLM-L6-v2"
    rc, out, err = cli("add", "kb", str(docs), str(note))
    assert rc == 0 and json.loads(out)["added"] == 4 and "index kb" in err      # the progress bar
    assert cli.loaded[-1] == "all-MiniLM-L6-v2"                                   # from the manifest
    rc, out, _ = cli("add", "kb", str(docs))
    assert json.loads(out)["unchanged"] == 3

    rc, out, _ = cli("search", "kb", "capital of Germany", "--mode", "hybrid", "--json")
    assert rc == 0 and json.loads(out)[0]["id"] == "b"
    rc, out, _ = cli("search", "kb", "capital", "--filter", '{"lang": "fr"}')
    assert rc == 0 and out.split()[2] == "c"
    rc, out, _ = cli("list")
    assert out.startswith("kb\tv1\tall-MiniLM-L6-v2\t384d\tflat\t4 documents")
    rc, out, _ = cli("verify", "kb")
    report = json.loads(out)
    assert rc == 0 and report["ok"] and report["counts"].get("faiss", report["counts"].get("dense")) == 4
    assert report["self_hits"] == report["sampled"] == 4
    rc, out, _ = cli("info", "kb")
    assert json.loads(out)["live_counts"]["documents"] == 4

    rc, out, _ = cli("delete", "kb", "--ids", "c", "zz")
    assert json.loads(out)["outcomes"] == {"c": "deleted", "zz": "missing"}
    rc, _, _ = cli("delete", "kb")
    assert rc == 0
    rc, _, err = cli("info", "kb")
    assert rc == 1 and "does not exist" in err


def test_bad_name_and_bad_jsonl_are_errors(cli, tmp_path):
    rc, _, err = cli("create", "../escape", "--model", "all-MiniLM-L6-v2")
    assert rc == 1 and "not allowed" in err
    cli("create", "kb", "--model", "all-MiniLM-L6-v2")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x"}\n')
    rc, _, err = cli("add", "kb", str(bad))
    assert rc == 1 and "bad.jsonl:1" in err

"""The manifest makes mixed vectors impossible: each field's mismatch (model, fingerprint,
dimension, normalization, metric, and the rest) is refused on open, write and search with a
409 naming the field and both values; names that try to leave the index root are refused (400)."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from embedserve.api.errors import status_for
from embedserve.embedders import ModelEmbedder
from index.errors import ConflictError, ValidationError
from index.docstore import Document
from index.manifest import MANIFEST, IndexCorruptError, ModelIdentity
from index.search import Query
from index.store import IndexStore

TEXTS = ["Paris is the capital of France.", "Berlin is the capital of Germany.", "Le chat dort sur le canapé."]

# user-facing field name -> (ModelIdentity attribute, manifest attribute, a different value)
FIELDS = {
    "model": ("model", "model", "other-model"),
    "fingerprint": ("fingerprint", "fingerprint", "0" * 64),
    "dimension": ("dimension", "dimension", 768),
    "normalization": ("normalize", "normalize", False),
    "metric": ("metric", "metric", "l2"),
    "pooling": ("pooling", "pooling", "cls"),
    "query_prefix": ("query_prefix", "query_prefix", "query: "),
    "sparse": ("has_sparse", "sparse", True),
}


@pytest.fixture(scope="module")
def vectors(minilm_model):
    v = ModelEmbedder(minilm_model).embed_documents(TEXTS)
    dense, sparse = v.dense, v.sparse
    return ModelIdentity.from_spec(minilm_model.spec), dense, sparse


@pytest.fixture
def store(tmp_path, vectors):
    ident, dense, sparse = vectors
    store = IndexStore(tmp_path / "root")
    with store.create("docs", ident) as ix:
        ix.upsert([Document(f"d{i}", t) for i, t in enumerate(TEXTS)], dense, sparse, ident)
    return store


def _other(ident: ModelIdentity, field: str) -> ModelIdentity:
    attr, _, value = FIELDS[field]
    return dataclasses.replace(ident, **{attr: value})


def _assert_names_field(exc: ConflictError, field: str, ours, theirs) -> None:
    assert status_for(exc)[0] == 409 and exc.code == "manifest_mismatch"
    assert exc.param == field
    assert f"{field} mismatch" in exc.message
    assert repr(ours) in exc.message and repr(theirs) in exc.message, exc.message


@pytest.mark.parametrize("field", FIELDS)
def test_mismatch_refused_on_open(store, vectors, field):
    ident = vectors[0]
    other = _other(ident, field)
    with pytest.raises(ConflictError) as e:
        store.open("docs", other)
    ours = store.manifest("docs").sparse if field == "sparse" else getattr(ident, FIELDS[field][0])
    _assert_names_field(e.value, field, ours, getattr(other, FIELDS[field][0]) if field != "sparse" else other.lexical)


@pytest.mark.parametrize("field", FIELDS)
def test_mismatch_refused_on_write(store, vectors, field):
    ident, dense, sparse = vectors
    with store.open("docs") as ix:           # opened without a model: info / verify style
        with pytest.raises(ConflictError) as e:
            ix.upsert([Document("new", "A new document.")], [dense[0]], [sparse[0]], _other(ident, field))
        assert e.value.param == field
        with pytest.raises(ConflictError):
            ix.delete(["d0"], _other(ident, field))
        assert ix.counts() == {"documents": 3, "dense": 3, "sparse": 3}


@pytest.mark.parametrize("field", FIELDS)
def test_mismatch_refused_on_search(store, vectors, field):
    ident, dense, _ = vectors
    with store.open("docs") as ix:
        with pytest.raises(ConflictError) as e:
            ix.search(Query(dense=dense[0]), _other(ident, field))
        assert e.value.param == field
        assert ix.search(Query(dense=dense[0]), ident)[0].id == "d0"


@pytest.mark.parametrize("field", FIELDS)
def test_hand_edited_manifest_is_refused(store, vectors, field):
    """A manifest written by another model (or by hand) disagrees with the model at hand."""
    ident = vectors[0]
    path = store.version_dir("docs", "v1") / MANIFEST
    raw = json.loads(path.read_text())
    _, key, value = FIELDS[field]
    raw[key] = "lexical_weights" if field == "sparse" else value
    path.write_text(json.dumps(raw))
    with pytest.raises(ConflictError) as e:
        store.open("docs", ident)
    assert e.value.param == field
    if field == "dimension":                 # the stored vectors contradict the manifest itself
        with pytest.raises(IndexCorruptError):
            store.open("docs")
    else:
        store.open("docs").close()           # still readable without a model (info, verify, delete)


def test_vectors_of_another_shape_or_norm_are_refused(store, vectors):
    ident, dense, sparse = vectors
    with store.open("docs", ident) as ix:
        with pytest.raises(ConflictError) as e:
            ix.upsert([Document("x", "x")], [np.ones(768, np.float32) / np.sqrt(768)], [sparse[0]], ident)
        assert e.value.param == "dimension" and "384" in e.value.message and "768" in e.value.message
        with pytest.raises(ConflictError) as e:
            ix.upsert([Document("x", "x")], [dense[0] * 3], [sparse[0]], ident)
        assert e.value.param == "normalization"
        with pytest.raises(ConflictError) as e:
            ix.search(Query(dense=np.ones(16, np.float32)), ident)
        assert e.value.param == "dimension"
        assert ix.counts()["documents"] == 3


def test_newer_format_version_is_refused(store, vectors):
    path = store.version_dir("docs", "v1") / MANIFEST
    raw = json.loads(path.read_text())
    raw["format_version"] = 99
    path.write_text(json.dumps(raw))
    with pytest.raises(ConflictError) as e:
        store.open("docs")
    assert e.value.param == "format_version" and "99" in e.value.message


@pytest.mark.parametrize("name", ["..", ".", "../docs", "../../etc", "/etc/passwd", "a/b", "a\\b", "", "x" * 65,
                                  ".hidden", "a b", "nul\x00", "名字", "docs/../docs", "~root"])
def test_names_that_leave_the_root_or_break_the_rule_are_refused(store, vectors, name):
    with pytest.raises(ValidationError) as e:
        store.open(name)
    assert status_for(e.value)[0] == 400 and e.value.code == "invalid_index_name"
    with pytest.raises(ValidationError):
        store.create(name, vectors[0])
    with pytest.raises(ValidationError):
        store.delete(name)


def test_links_leaving_the_root_are_refused(tmp_path, store, vectors):
    outside = IndexStore(tmp_path / "outside")
    outside.create("secret", vectors[0]).close()
    os.symlink(tmp_path / "outside" / "secret", store.root / "escape")
    with pytest.raises(ValidationError) as e:
        store.open("escape")
    assert e.value.code == "path_outside_root"
    assert "escape" not in store.names()
    # A link whose target stays inside the root is just another name.
    os.symlink(store.root / "docs", store.root / "alias")
    with store.open("alias") as ix:
        assert ix.counts()["documents"] == 3


def test_version_names_are_checked_too(store):
    for version in ("../v1", "v1/..", "1", "vx"):
        with pytest.raises(ValidationError):
            store.open("docs", version=version)
    (store.index_dir("docs") / "CURRENT").write_text("../../etc\n")
    with pytest.raises(ValidationError):
        store.open("docs")

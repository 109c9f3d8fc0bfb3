"""`embedserve reindex --index NAME --to-model MODEL` (and `--rollback`): the migration of an
index to another embedding model, in this process (no server needed)."""

from __future__ import annotations

import functools
import json
import logging
import sys

from index.errors import DescribedError

from .index import add_store_flags, store_from_args


def register(subparsers) -> None:
    p = subparsers.add_parser("reindex", help="re-embed an index with another model: resumable, gated, "
                              "swapped atomically; --rollback undoes the last one")
    p.add_argument("--index", required=True, dest="name", help="the index to migrate")
    p.add_argument("--to-model", help="bundled model name or local HF directory")
    p.add_argument("--prompt", action="append", default=[], metavar="NAME=TEXT",
                   help="a prompt of the new version (repeat for several: query=..., passage=..., or a named one); "
                   "with the live model (no --to-model) this is a prompt migration: same weights, re-embedded")
    p.add_argument("--to-sparse-model", default=None,
                   help="a pair index's sparse model (SPLADE) in the new version [default: the live version's; "
                   "none: no paired sparse model]")
    p.add_argument("--rollback", action="store_true", help="make the version the last migration replaced live again, carrying over the "
                   "writes made since the swap (re-embedded with that version's model)")
    p.add_argument("--dry-run", action="store_true", help="build and verify the new version, but do not swap")
    p.add_argument("--sample", type=int, default=1000, help="documents the gate checks as their own top hit")
    p.add_argument("--batch-docs", type=int, default=256, help="documents per embedded, checkpointed batch")
    p.add_argument("--dtype", default="auto", help="the new model's precision (auto | float32 | bfloat16 | int8)")
    p.add_argument("--engine", choices=("in-process", "ray"), default="in-process",
                   help="where the bulk re-embedding runs: this process, or a Ray cluster with Ray Data "
                   "(pip install 'embedserve[ray]')")
    p.add_argument("--ray-address", default=None,
                   help="an existing Ray cluster (e.g. ray://head:10001 or auto); default: start a local Ray here")
    p.add_argument("--ray-actors", type=int, default=None,
                   help="embedding actors, each loading the model once [default: cluster CPUs / --ray-cpus-per-actor]")
    p.add_argument("--ray-cpus-per-actor", type=float, default=1.0, help="CPUs (and torch threads) per actor")
    add_store_flags(p)
    p.set_defaults(func=cmd_reindex)


def _prompts(pairs: list[str]) -> dict[str, str]:
    """`--prompt NAME=TEXT` values as a dict (ValidationError naming a malformed one)."""
    from ..errors import ValidationError
    out = {}
    for pair in pairs:
        name, sep, text = pair.partition("=")
        if not sep or not name.strip():
            raise ValidationError(f"--prompt {pair!r}: give NAME=TEXT, e.g. --prompt 'query=Represent this "
                                  "question for retrieval: '")
        out[name.strip()] = text
    return out


def _embedder(model: str, dtype: str, sparse_model: str | None = None, prompts: dict | None = None):
    from ..embedders import load_embedder
    from ..errors import ValidationError
    try:
        return load_embedder(model, dtype, sparse_model=sparse_model, prompts=prompts)
    except ValueError as exc:               # e.g. a reranker named as the new model
        raise ValidationError(f"--to-model {model}: {exc}") from None


def cmd_reindex(args) -> int:
    from migrations import for_store

    from .logs import setup_logging
    setup_logging(logging.INFO)
    try:
        store = store_from_args(args)
        reindex = for_store(store).reindex
        if args.rollback:
            _print(_rollback(store, args.name, args.dtype, args.batch_docs))
            return 0
        if not args.to_model and not args.prompt:
            print("embedserve reindex: error: --to-model or --prompt is required (or --rollback)", file=sys.stderr)
            return 2
        store.current(args.name)                      # a clear error before any model loads
        live = store.manifest(args.name)
        sparse = args.to_sparse_model or live.sparse_model
        sparse = None if sparse == "none" else sparse
        model = args.to_model or live.model
        # the same model keeps the live version's prompts (what --prompt changes); another brings its own
        prompts = {**(live.prompt_texts() if model == live.model else {}), **_prompts(args.prompt)}
        embedder = _embedder(model, args.dtype, sparse, prompts or None)
        old_embedder = _old_embedder(store, args.name, args.dtype)
        engine = _engine(args, model, embedder.model.precision, sparse, prompts or None)
        try:
            with _progress(store, args.name) as tick:
                entry = reindex(store, args.name, embedder, batch_docs=args.batch_docs, sample=args.sample,
                                dry_run=args.dry_run, old_embedder=old_embedder, on_batch=tick, engine=engine)
        finally:
            if engine is not None:
                engine.close()
    except DescribedError as exc:
        print(f"embedserve reindex: error: {exc.message}", file=sys.stderr)
        report = getattr(exc, "report", None)
        if report is not None:
            _print(report.to_dict())
        return 1
    _print(entry)
    return 0


def _engine(args, model: str, precision: str, sparse_model: str | None = None, prompts: dict | None = None):
    """The Ray engine for the bulk pass (None in process); its actors load the model by name in
    the precision `--dtype` settled on here, so every worker computes what this process would."""
    if args.engine != "ray":
        return None
    from migrations.ray_engine import RayEngine
    from ..embedders import load_embedder
    load = functools.partial(load_embedder, sparse_model=sparse_model, prompts=prompts)
    return RayEngine(load, (model, precision), address=args.ray_address,
                     actors=args.ray_actors, cpus_per_actor=args.ray_cpus_per_actor)


def _rollback(store, name: str, dtype: str, batch_docs: int) -> dict:
    """Roll back, loading the parent version's model only when documents written since the swap
    need re-embedding (else it is a move of `CURRENT`, under a second)."""
    from migrations import for_store
    mig = for_store(store)
    pending = mig.writes_since_swap(store, name)
    embedder = None
    if pending["texts"]:
        logging.getLogger(__name__).info("%d document(s) written since the swap need %s: loading it",
                                         pending["texts"], pending["model"])
        embedder = _embedder(pending["model"], dtype, pending.get("sparse_model"), pending.get("prompts"))
    return mig.rollback(store, name, embedder, batch_docs=batch_docs)


def _old_embedder(store, name: str, dtype: str):
    """The live version's model, for the old-vs-new overlap the gate prints (None if unavailable)."""
    try:
        m = store.manifest(name)
        return _embedder(m.model, dtype, m.sparse_model, m.prompt_texts())
    except (FileNotFoundError, ValueError) as exc:
        logging.getLogger(__name__).warning("old model unavailable (%s): no top-10 overlap", exc)
        return None


class _progress:
    """tqdm (documents/s, ETA) on a terminal, a log line per batch otherwise."""

    def __init__(self, store, name: str):
        self.total = store.manifest(name).counts.get("documents") or None
        self.bar = None
        self.done = 0

    def __enter__(self):
        if sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=self.total, unit="doc", desc="reindex")
        return self.tick

    def tick(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        else:
            logging.getLogger("embedserve.reindex").info("copied %d documents", self.done)

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()


def _print(obj) -> None:
    print(json.dumps(obj, indent=2, ensure_ascii=False))

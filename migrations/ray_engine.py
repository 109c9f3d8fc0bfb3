"""Re-embedding on a Ray cluster with Ray Data, for corpora past one machine (`--engine ray`).

    live write sequences (wseq) ──cut into shards of `batch_docs`──▶ from_items(shards)
        ──map_batches(read shard, on the driver's node: the doc store lives there)──▶ rows
        ──map_batches(_EmbedActor, actor pool: each actor loads the model once)──▶ vectors
        ──iter_batches(preserve_order)──▶ the driver commits each batch in write order + checkpoint

Only the bulk copy runs here; the checkpoint, the catch-up passes, the gate and the swap are the
in-process migration's (`migrations.reindex`), so a run killed midway resumes the same way with
either engine. Ray is an optional extra (`pip install 'embedserve[ray]'`): this module imports it
only when an engine is built, and nothing else in the project imports it.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable, Iterator

import numpy as np

from index.backend import read_documents
from index.docstore import Document
from index.embedder import DocumentVectors

from .errors import MigrationError

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'embedserve[ray]'"


def _import_ray():
    try:
        import ray
        import ray.data  # noqa: F401  (the Data library is the `ray[data]` extra)
    except ImportError as exc:
        raise MigrationError(f"--engine ray needs Ray Data, which is not installed ({exc}); install it with "
                             f"{INSTALL_HINT}", code="ray_missing") from exc
    return ray


def _read_shards(batch: dict[str, np.ndarray], db: str) -> dict[str, np.ndarray]:
    """Ray Data stage 1 (a task on the driver's node): the documents of each shard (a range of write sequences)."""
    rows: list[tuple[int, Document]] = []
    for after, upto in zip(batch["after"], batch["upto"]):
        rows.extend(read_documents(db, int(after), int(upto)))
    return {"seq": np.array([r[0] for r in rows], dtype=np.int64),
            "id": np.array([r[1].id for r in rows], dtype=object),
            "text": np.array([r[1].text for r in rows], dtype=object),
            "metadata": np.array([json.dumps(r[1].metadata, ensure_ascii=False) for r in rows], dtype=object)}


class _EmbedActor:
    """Ray Data stage 2 (an actor of the pool): loads the model once, then embeds batches of rows.
    Sparse terms travel as raw little-endian bytes (int64 ids, float32 weights): no pickling."""

    def __init__(self, load: Callable[..., Any], load_args: tuple, load_kwargs: dict):
        self.embedder = load(*load_args, **load_kwargs)
        self.fingerprint = self.embedder.identity.fingerprint

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        vectors = self.embedder.embed_documents([str(t) for t in batch["text"]])
        cut = np.zeros(len(batch["text"]), dtype=bool)
        cut[vectors.truncated] = True
        return {**batch,
                "dense": np.stack(vectors.dense).astype(np.float32),
                "sparse_ids": np.array([np.asarray(i, "<i8").tobytes() for i, _ in vectors.sparse], dtype=object),
                "sparse_w": np.array([np.asarray(w, "<f4").tobytes() for _, w in vectors.sparse], dtype=object),
                "cut": cut,
                "fingerprint": np.array([self.fingerprint] * len(cut), dtype=object)}


def shards(seqs: np.ndarray, after: int, size: int) -> list[tuple[int, int]]:
    """(after, upto] ranges of write sequences holding at most `size` live documents each,
    covering `seqs` (ascending) in order."""
    out = []
    for start in range(0, len(seqs), size):
        upto = int(seqs[min(start + size, len(seqs)) - 1])
        out.append((after, upto))
        after = upto
    return out


class RayEngine:
    """The bulk copy on Ray. `load(*load_args, **load_kwargs)` builds the embedder in each actor
    (a module-level function, shipped by reference: the workers need embedserve and the model
    installed, as they do in the image a cluster runs)."""

    def __init__(self, load: Callable[..., Any], load_args: tuple, *, address: str | None = None,
                 actors: int | None = None, cpus_per_actor: float = 1.0, num_cpus: int | None = None):
        self.ray = _import_ray()
        self.load, self.load_args = load, load_args
        self.cpus_per_actor = cpus_per_actor
        self.started = False
        if not self.ray.is_initialized():
            if address:
                self.ray.init(address=address, logging_level=logging.WARNING)
            else:
                # a local Ray on this machine; workers get our EMBEDSERVE_* settings (home, caches)
                env = {k: v for k, v in os.environ.items() if k.startswith("EMBEDSERVE_")}
                self.ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING,
                              runtime_env={"env_vars": env})
            self.started = True
        cpus = self.ray.cluster_resources().get("CPU", 1)
        self.actors = actors or max(1, int(cpus // cpus_per_actor))
        logger.info("ray: %s CPUs, %d embedding actors of %s CPU each", cpus, self.actors, cpus_per_actor)

    def batches(self, db: str, seqs: np.ndarray, after: int, batch_docs: int,
                fingerprint: str) -> Iterator[tuple[list[tuple[int, Document]], DocumentVectors]]:
        """The live documents last written at these sequence numbers, embedded, in write order,
        `batch_docs` at a time (one rewritten meanwhile is left to the next catch-up pass)."""
        if len(seqs) == 0:
            return
        from ray.data import ActorPoolStrategy, DataContext

        ctx = DataContext.get_current()
        ctx.execution_options.preserve_order = True          # results come back in write order
        ctx.enable_progress_bars = False                     # the CLI draws its own
        parts = shards(seqs, after, batch_docs)
        here = {"ray.io/node-id": self.ray.get_runtime_context().get_node_id()}   # where the doc store is
        ds = (self.ray.data.from_items([{"after": a, "upto": u} for a, u in parts],
                                       override_num_blocks=len(parts))
              # SQLite reads are I/O: no CPU reserved, so they never wait behind the actors
              .map_batches(_read_shards, fn_kwargs={"db": str(db)}, batch_size=1, batch_format="numpy",
                           num_cpus=0, label_selector=here)
              .map_batches(_EmbedActor, fn_constructor_kwargs={"load": self.load, "load_args": self.load_args,
                                                               "load_kwargs": {"threads": _threads(self.cpus_per_actor)}},
                           batch_size=batch_docs, batch_format="numpy",
                           compute=ActorPoolStrategy(size=self.actors), num_cpus=self.cpus_per_actor))
        last = after
        for b in ds.iter_batches(batch_size=batch_docs, batch_format="numpy"):
            if set(b["fingerprint"]) != {fingerprint}:
                raise MigrationError(f"the Ray workers loaded another model (fingerprints {sorted(set(b['fingerprint']))}, "
                                     f"expected {fingerprint}): give the cluster the same model files", code="ray_model")
            seqs_b = b["seq"].astype(np.int64)
            if seqs_b[0] <= last or np.any(np.diff(seqs_b) <= 0):
                raise MigrationError("Ray returned documents out of write order", code="ray_order")
            last = int(seqs_b[-1])
            rows = [(int(q), Document(str(i), str(t), json.loads(m)))
                    for q, i, t, m in zip(seqs_b, b["id"], b["text"], b["metadata"])]
            sparse = [(np.frombuffer(i, "<i8").astype(np.int64), np.frombuffer(w, "<f4").astype(np.float32))
                      for i, w in zip(b["sparse_ids"], b["sparse_w"])]
            yield rows, DocumentVectors(list(b["dense"].astype(np.float32)), sparse,
                                        [j for j, c in enumerate(b["cut"]) if c])

    def close(self) -> None:
        if self.started:
            self.ray.shutdown()
            self.started = False


def _threads(cpus_per_actor: float) -> int:
    return max(1, int(cpus_per_actor))

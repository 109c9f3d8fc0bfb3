"""`make bench`'s encoder in process against the ONNX runtimes a user would deploy instead:
ours vs OpenVINO vs ONNX Runtime, same model, texts, batches, precision and threads.

For each of `peers.EMBED_MODELS`:

- texts: `corpus(N_TEXTS)`, tokenized and truncated by our model, sorted by length and cut into
  4,096-token batches by `embedders.token_batches`, exactly as `encoder_in_process` does. Every
  side gets those token ids; the ONNX peers each batch padded to its longest, with a mask.
- the graph: transformers' `AutoModel` from the same model directory, exported by this bench
  with `torch.onnx.export` (the classic TorchScript exporter, `dynamo=False`: the dynamo one
  needs onnxscript, which the main venv does not have), fp32, opset 17, dynamic batch and sequence
  axes, inputs input_ids / attention_mask (/ token_type_ids), output last_hidden_state.
- the peers: OpenVINO (CPU plugin, its precision hint set explicitly, LATENCY) and ONNX Runtime
  (CPU provider, all graph optimizations, fp32 only), each in a subprocess of
  .bench-peers/openvino (`make .bench-peers/openvino/.ok`) running encoder_worker.py; a peer not
  installed is reported as such, never estimated. They stop at last_hidden_state; ours goes on
  to the pooled, normalized vector (a few hundred kFLOPs per text, next to ~20 MFLOPs per token).
- precisions: fp32 on every side; bf16 too (ours and OpenVINO) where the CPU has fast bf16.
- timing: THREADS threads on every side; one warm-up pass each, then `runs + 2` rounds
  alternating the sides (this machine's speed drifts within minutes); tokens/s of real tokens,
  medians; the ratios ours/OpenVINO and ours/ONNX Runtime.
- fidelity: the peers' last_hidden_state of the first batch (the longest texts), pooled as our
  model pools, against our vectors (max |Δ|, lowest cosine).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import warnings
from pathlib import Path

import numpy as np

from .embeddings import corpus
from .peers import EMBED_MODELS, PEERS, log, med, peer_precision

N_TEXTS = 512
THREADS = 2
BUDGET = 4096                  # tokens per batch, the server's default budget
OPSET = 17
WORKER = Path(__file__).with_name("encoder_worker.py")
PEER_NAMES = {"openvino": "OpenVINO", "onnxruntime": "ONNX Runtime"}


def export_onnx(model_dir: Path, out: Path) -> list[str]:
    """transformers' AutoModel of `model_dir` as an fp32 ONNX graph at `out` (dynamic batch and
    sequence); returns its input names."""
    import inspect

    import torch
    from transformers import AutoModel
    hf = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa").eval()
    names = ["input_ids", "attention_mask"]
    if getattr(hf.config, "type_vocab_size", 0) and "token_type_ids" in inspect.signature(hf.forward).parameters:
        names.append("token_type_ids")

    class LastHidden(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, *inputs):
            return self.m(**dict(zip(names, inputs))).last_hidden_state

    # the example has a padded row, so that the traced graph is the one a padded batch takes
    ids = torch.arange(16).reshape(2, 8) + 5
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    example = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
    axes = {0: "batch", 1: "sequence"}
    with warnings.catch_warnings(), torch.inference_mode():
        # the tracer's warnings are about shape checks that hold for every encoder input (the
        # test compares padded batches with our encoder); the legacy exporter's deprecation notice
        warnings.simplefilter("ignore")
        torch.onnx.export(LastHidden(hf), tuple(example[n] for n in names), str(out), input_names=names,
                          output_names=["last_hidden_state"], opset_version=OPSET, dynamo=False,
                          dynamic_axes={**{n: axes for n in names}, "last_hidden_state": axes})
    return names


def pad_batch(batch: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Token-id lists as (B, S) input_ids padded with `pad_id` and their (B, S) attention mask, int64."""
    width = max(len(x) for x in batch)
    ids = np.full((len(batch), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(batch), width), dtype=np.int64)
    for k, x in enumerate(batch):
        ids[k, :len(x)] = x
        mask[k, :len(x)] = 1
    return ids, mask


def write_batches(batches: list[list[list[int]]], pad_id: int, path: Path) -> int:
    """The batches, padded, as the worker's .npz; returns the padded token count."""
    arrays, padded = {"n": np.array(len(batches))}, 0
    for i, b in enumerate(batches):
        arrays[f"ids{i}"], arrays[f"mask{i}"] = pad_batch(b, pad_id)
        padded += arrays[f"ids{i}"].size
    np.savez(path, **arrays)
    return padded


def pooled(model, hidden: np.ndarray, lengths: list[int]) -> np.ndarray:
    """A padded (B, S, H) last_hidden_state pooled as `model` (our EmbeddingModel) pools: (B, H)."""
    import torch
    packed = torch.from_numpy(np.concatenate([hidden[k, :L] for k, L in enumerate(lengths)]).astype(np.float32))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return model.pool(packed, lengths, starts).numpy()


def agreement(ours: np.ndarray, theirs: np.ndarray) -> dict:
    cos = (ours * theirs).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1))
    return {"max_abs_diff": float(np.abs(ours - theirs).max()), "min_cosine": float(cos.min())}


def openvino_missing() -> str | None:
    """Why the peers' venv cannot run (its stamp: the venv's python exists before its packages do), or None."""
    ok = PEERS / "openvino" / ".ok"
    return None if ok.exists() else f"not installed ({ok} missing; `make bench-peers` builds it)"


class Worker:
    """One ONNX peer in its subprocess (encoder_worker.py): started and warmed up, then one timed
    pass per `run()`, while the other sides wait."""

    def __init__(self, runtime: str, onnx: Path, batches: Path, precision: str, dump: Path):
        python = PEERS / "openvino" / "bin" / "python"
        env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
        # -I: the script's folder (this package) stays off sys.path, as do PYTHON* variables
        self.proc = subprocess.Popen([str(python), "-I", str(WORKER), "--onnx", str(onnx), "--batches", str(batches),
                                      "--runtime", runtime, "--precision", precision, "--threads", str(THREADS),
                                      "--dump", str(dump)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.ready = self._answer(f"{runtime} {precision} start-up")

    def _answer(self, what: str) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"encoder worker exited during {what} (rc {self.proc.wait()}); its stderr is above")
        return json.loads(line)

    def run(self) -> float:
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        return self._answer("a timed pass")["seconds"]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def compare_precision(model, batches: list[list[list[int]]], tokens: int, onnx: Path, npz: Path,
                      precision: str, runs: int, work: Path) -> dict:
    """One precision: ours (`model`, loaded in it) and the installed peers, alternated."""
    out: dict = {"precision": {"ours": model.precision}}
    ref = np.stack([o.dense for o in model.embed(batches[0], {"dense"})[0]])

    def run_ours() -> float:
        t0 = time.perf_counter()
        for b in batches:
            model.embed(b, {"dense"})
        return time.perf_counter() - t0

    sides = {"ours": run_ours}
    workers: list[Worker] = []
    runtimes = ("openvino", "onnxruntime") if precision == "float32" else ("openvino",)
    missing = openvino_missing()
    try:
        for rt in runtimes:
            if missing:
                out[rt] = {"not_run": missing}
                continue
            dump = work / f"{rt}-{precision}-first.npy"
            w = Worker(rt, onnx, npz, precision, dump)
            workers.append(w)
            if not w.ready["output_shapes_ok"]:
                raise RuntimeError(f"{rt}: last_hidden_state is not (batch, sequence, hidden) on every batch")
            sides[rt] = w.run
            out[rt] = {"version": w.ready["version"], "settings": w.ready["settings"],
                       "compile_s": w.ready["compile_s"], "output_shapes_ok": w.ready["output_shapes_ok"]}
            out["precision"][rt] = precision
            out.setdefault("agreement", {})[rt] = agreement(ref, pooled(model, np.load(dump),
                                                                        [len(x) for x in batches[0]]))
            log(f"    {PEER_NAMES[rt]} {w.ready['version']} ready ({w.ready['settings']}); first batch vs ours: "
                f"{out['agreement'][rt]}")
        run_ours()                                                # ours' warm-up (the workers warmed up at start)
        times: dict[str, list[float]] = {k: [] for k in sides}
        for _ in range(runs + 2):                                 # alternated: the machine's speed drifts
            for k, fn in sides.items():
                times[k].append(fn())
    finally:
        for w in workers:
            w.close()
    for k, ts in times.items():
        out.setdefault(k, {}).update(tokens_per_s=tokens / med(ts), seconds=ts)
    out["ratio"] = {f"ours/{k}": out["ours"]["tokens_per_s"] / out[k]["tokens_per_s"] for k in times if k != "ours"}
    log(f"  {precision}: " + ", ".join(f"{k} {out[k]['tokens_per_s']:.0f}" for k in times) + " tokens/s; "
        + ", ".join(f"{k} {v:.2f}x" for k, v in out["ratio"].items()))
    return out


def bench_encoder_peers(runs: int, work: Path) -> dict:
    """Every model of `EMBED_MODELS`, fp32 (and bf16 where fast): see the module's docstring."""
    import torch

    from embedserve.embedders import token_batches
    from embedserve.models.embedding_model import EmbeddingModel
    from embedserve.models.registry import resolve_model
    texts = corpus(N_TEXTS)
    precisions = ("float32", "bfloat16") if peer_precision() == "bfloat16" else ("float32",)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    result: dict = {"threads": THREADS, "budget": BUDGET, "opset": OPSET, "models": {}}
    try:
        for model_name in EMBED_MODELS:
            name, path = resolve_model(model_name)
            log(f"  {model_name}")
            res: dict = {"model_dir": str(path)}
            model = EmbeddingModel(path, name=name, dtype="float32")
            ids = [model.truncate(x) for x in model.tokenize(texts)]
            order = sorted(ids, key=len, reverse=True)
            batches = [[order[i] for i in b] for b in token_batches([len(x) for x in order], BUDGET)]
            tokens = sum(len(x) for x in ids)
            npz = work / f"encoder-{model_name}.npz"
            padded = write_batches(batches, model.cfg.pad_token_id, npz)
            res["workload"] = {"texts": len(texts), "tokens": tokens, "padded_tokens": padded, "batches": len(batches)}
            onnx = work / f"{model_name}.onnx"
            t0 = time.perf_counter()
            res["onnx_inputs"] = export_onnx(path, onnx)
            res["export_s"] = time.perf_counter() - t0
            for precision in precisions:
                if precision != "float32":
                    model = EmbeddingModel(path, name=name, dtype=precision)
                res[precision] = compare_precision(model, batches, tokens, onnx, npz, precision, runs, work)
            result["models"][model_name] = res
    finally:
        torch.set_num_threads(threads_before)
    return result

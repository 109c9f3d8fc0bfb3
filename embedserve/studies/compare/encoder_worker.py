"""The ONNX side of `make bench`'s encoder comparison (encoder_peers.py), run as a script by
.bench-peers/openvino's python: numpy, openvino and onnxruntime only (no embedserve, no torch).

    python encoder_worker.py --onnx model.onnx --batches batches.npz --runtime openvino \
        --precision float32 --threads 2 --dump first.npy

It compiles the graph, runs every batch once (the warm-up; each output's shape checked, the first
batch's last_hidden_state written to --dump), prints one JSON line (`ready`), then runs one timed
pass per `run` line on stdin, answering `{"seconds": ...}`, until EOF. The caller alternates the
sides round by round, so this process waits, idle, while the others are timed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np


def load_batches(path: str) -> list[dict[str, np.ndarray]]:
    """The padded batches of `write_batches` (encoder_peers): input_ids and attention_mask, each
    (B, S) int64, plus zero token_type_ids where the graph takes them (added by `feeds`)."""
    z = np.load(path)
    return [{"input_ids": z[f"ids{i}"], "attention_mask": z[f"mask{i}"]} for i in range(int(z["n"]))]


def feeds(batches: list[dict[str, np.ndarray]], names: list[str]) -> list[dict[str, np.ndarray]]:
    out = []
    for b in batches:
        f = {k: v for k, v in b.items() if k in names}
        if "token_type_ids" in names:
            f["token_type_ids"] = np.zeros_like(b["input_ids"])
        out.append(f)
    return out


def onnxruntime_runner(onnx: str, threads: int):
    """ONNX Runtime's CPU provider, fp32: `threads` intra-op threads, one inter-op, every graph
    optimization. Returns (run(feed) -> last_hidden_state, input names, version, settings)."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(onnx, so, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    return (lambda feed: sess.run(["last_hidden_state"], feed)[0]), names, ort.__version__, {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1, "graph_optimization_level": "ORT_ENABLE_ALL",
        "providers": sess.get_providers()}


def openvino_runner(onnx: str, precision: str, threads: int):
    """OpenVINO's CPU plugin on the ONNX graph (read directly, dynamic shapes kept): the precision
    hint given explicitly (its default on a bf16 CPU would be bf16), `threads` threads, LATENCY
    (one stream, one request reused). Returns what `onnxruntime_runner` does."""
    import openvino as ov
    core = ov.Core()
    model = core.read_model(onnx)
    compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": {"float32": "f32", "bfloat16": "bf16"}[precision],
                                                 "INFERENCE_NUM_THREADS": threads, "PERFORMANCE_HINT": "LATENCY"})
    req = compiled.create_infer_request()
    names = [p.any_name for p in compiled.inputs]
    out = compiled.output("last_hidden_state")
    settings = {k: compiled.get_property(k) for k in ("INFERENCE_PRECISION_HINT", "INFERENCE_NUM_THREADS",
                                                     "PERFORMANCE_HINT", "NUM_STREAMS")}
    settings = {k: v.to_string() if isinstance(v, ov.Type) else str(v) for k, v in settings.items()}   # f32, bf16
    return (lambda feed: req.infer(feed)[out]), names, ov.get_version(), settings


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--onnx", required=True)
    ap.add_argument("--batches", required=True)
    ap.add_argument("--runtime", choices=("openvino", "onnxruntime"), required=True)
    ap.add_argument("--precision", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dump", default=None, help="write the first batch's last_hidden_state here (.npy)")
    args = ap.parse_args(argv)
    if args.runtime == "onnxruntime" and args.precision != "float32":
        ap.error("ONNX Runtime runs fp32 only here")
    t0 = time.perf_counter()
    if args.runtime == "openvino":
        run, names, version, settings = openvino_runner(args.onnx, args.precision, args.threads)
    else:
        run, names, version, settings = onnxruntime_runner(args.onnx, args.threads)
    compile_s = time.perf_counter() - t0
    batches = feeds(load_batches(args.batches), names)
    t0 = time.perf_counter()
    shapes_ok = True
    for i, f in enumerate(batches):                               # the warm-up pass
        h = np.asarray(run(f))
        b, s = f["input_ids"].shape
        shapes_ok &= h.ndim == 3 and h.shape[:2] == (b, s)
        if i == 0 and args.dump:
            np.save(args.dump, h.astype(np.float32))
    print(json.dumps({"ready": True, "version": version, "settings": settings, "compile_s": compile_s,
                      "warmup_s": time.perf_counter() - t0, "output_shapes_ok": bool(shapes_ok),
                      "hidden_size": int(h.shape[-1])}), flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            continue
        t0 = time.perf_counter()
        for f in batches:
            run(f)
        print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

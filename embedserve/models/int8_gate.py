"""The accuracy gate that `--decode-weights auto` puts in front of weight-only int8 decoding: the
int8 model is used only where, against the same model in its native precision,

* greedy continuations of held-out prompts are the same tokens up to near-ties: where the two
  first part, the native model's logits for the two candidates are within `TIE` of each other
  (the one-step logit noise int8 weights add is ~0.05-0.3 on SmolLM2; an argmax decided by
  less than that is a coin toss either precision could win), and
* the perplexity of held-out text is within `MAX_PPL_RATIO` (1 %) of the native model's.

No text here was used to quantize (per-channel max scaling reads only the weights), so all of
it is held out. The gate runs once per model, precision and gate version on a machine (~10 s
for SmolLM2-135M on 2 AVX2 cores); its report is cached under $EMBEDSERVE_CACHE_DIR (default $EMBEDSERVE_HOME)/gates/, keyed
by the model's fingerprint, and written to the log and `/v1/models`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .attention_dispatch import AttentionMetadata

logger = logging.getLogger(__name__)

GATE_VERSION = 4               # 3: float32 and bf16 activations summed through int16 (gemv_w8_f32 / gemv_w8_bf16);
                               # 4: the greedy runs over the engine's default cache (float16 under float32)
TIE = 0.5                  # native-logit gap under which two greedy choices are a near-tie
MAX_PPL_RATIO = 1.01
NEW_TOKENS = 32

PROMPTS = (
    "The main reasons a city builds a subway instead of more roads are",
    "Question: Why does ice float on water?\nAnswer:",
    "Here is a short Python function that returns the largest value in a list:\n\ndef",
    "A good summary of the document should",
    "The museum opened in the spring, and its first exhibition",
    "Step 1: Preheat the oven. Step 2:",
    "Dear team, thank you for the update on the migration. Before we",
    "In statistics, the median of a set of numbers is",
)

TEXTS = (
    "The river rises in the hills to the north of the town and runs south through a narrow valley "
    "before it reaches the plain. For most of the year it is shallow enough to cross on foot, but "
    "after the autumn rains it can rise by several metres in a single night. The old stone bridge "
    "was built after a flood carried away the wooden one in the last century, and the marks that "
    "the water left on its piers are still visible. Farmers on the plain depend on the river for "
    "their fields, and a system of small canals, some of them several hundred years old, carries "
    "the water to the orchards and the vegetable gardens along both banks.",
    "When a search system receives a question, it first turns the text into a vector and looks for "
    "the stored passages whose vectors are closest. The passages it finds are then read by a second "
    "model, which scores each of them against the question and keeps only the best few. Finally a "
    "language model writes an answer from those passages, and it is asked to say which of them it "
    "used. Each stage can fail on its own: the first may miss a passage that uses different words, "
    "the second may prefer a long passage that only repeats the question, and the last may state "
    "something that none of the passages says. Measuring each stage separately is the only way to "
    "know which one to improve.",
)


@dataclass
class GateReport:
    passed: bool
    reason: str
    prompts: int
    equal: int              # continuations equal to the native model's, all NEW_TOKENS of them
    ties: int               # parted at a near-tie
    worst_gap: float        # the largest native-logit gap where a continuation parted (0 if none)
    mean_equal_tokens: float  # tokens equal before a continuation parts (NEW_TOKENS where none does)
    ppl_native: float
    ppl_int8: float
    ppl_ratio: float
    seconds: float
    version: int = GATE_VERSION


def sequence_logits(model, ids: list[int], last_only: bool = False, kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """(len(ids), V) float32 logits of one sequence in one prefill, on a KV pool of its own in
    `kv_dtype` (default the model's; attention reads it back) (`last_only`: the last position's
    only, (1, V))."""
    cfg = model.cfg
    bs = 16
    nb = -(-len(ids) // bs)
    shape = (nb, bs, cfg.num_key_value_heads, cfg.head_dim)
    kv_dtype = kv_dtype or model.dtype
    caches = [(torch.zeros(shape, dtype=kv_dtype, device=model.device),
               torch.zeros(shape, dtype=kv_dtype, device=model.device)) for _ in range(cfg.num_hidden_layers)]
    T = len(ids)
    dev = model.device
    meta = AttentionMetadata(slot_mapping=torch.arange(T, device=dev),
                             block_tables=torch.arange(nb, dtype=torch.int32, device=dev)[None],
                             context_lens=torch.tensor([T], dtype=torch.int32, device=dev),
                             cu_seqlens_q=torch.tensor([0, T], dtype=torch.int32, device=dev),
                             num_decodes=int(T == 1), context_lens_list=[T], q_lens_list=[T])
    hidden = model.forward(torch.tensor(ids, device=dev), torch.arange(T, device=dev), caches, meta)
    return model.logits(hidden[-1:] if last_only else hidden)


def perplexity(model, texts_ids: list[list[int]], kv_dtype: torch.dtype | None = None) -> float:
    nll, n = 0.0, 0
    for ids in texts_ids:
        logp = torch.log_softmax(sequence_logits(model, ids, kv_dtype=kv_dtype)[:-1], dim=-1)
        target = torch.tensor(ids[1:], device=logp.device)
        nll -= float(logp.gather(1, target[:, None]).sum())
        n += len(ids) - 1
    return math.exp(nll / n)


def greedy(model, tokenizer, prompts: list[list[int]], new_tokens: int, kv_cache_dtype: str = "auto") -> list[list[int]]:
    from ..config import DecodeConfig
    from ..engine.decode_engine import DecodeEngine
    from ..engine.sequence import SamplingParams
    longest = max(map(len, prompts)) + new_tokens
    eng = DecodeEngine(model, tokenizer, DecodeConfig(block_size=16, max_model_len=longest, max_num_batched_tokens=512,
                                                      max_num_seqs=len(prompts), kv_cache_dtype=kv_cache_dtype),
                       num_blocks=len(prompts) * (-(-longest // 16)))
    seqs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    return [s.token_ids[len(p):] for s, p in zip(seqs, prompts)]


def first_parting(model, prompt: list[int], ref: list[int], got: list[int]) -> tuple[int, float] | None:
    """Where the greedy continuation `got` of `prompt` first parts from `ref`, and `model`'s logit
    gap there between ref's token and got's; None where they agree."""
    t = next((i for i, (x, y) in enumerate(zip(ref, got)) if x != y), None)
    if t is None:
        return None
    logits = sequence_logits(model, prompt + ref[:t], last_only=True)[0]
    return t, float(logits[ref[t]] - logits[got[t]])


def run_gate(native, int8, tokenizer, new_tokens: int = NEW_TOKENS) -> GateReport:
    """Compare `int8` with `native` (two LlamaModels of the same weights) on the held-out
    prompts and texts."""
    t0 = time.perf_counter()
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    ref, got = greedy(native, tokenizer, prompts, new_tokens), greedy(int8, tokenizer, prompts, new_tokens)
    equal = ties = 0
    worst, same = 0.0, []
    failure = ""
    for p, a, b in zip(prompts, ref, got):
        part = first_parting(native, p, a, b)
        same.append(len(a) if part is None else part[0])
        if part is None:
            equal += 1
            continue
        t, gap = part
        worst = max(worst, gap)
        if gap <= TIE:
            ties += 1
        elif not failure:
            failure = (f"a greedy continuation parts from the native model's at step {t} where the native logits "
                       f"differ by {gap:.3f} (> {TIE}: no near-tie)")
    texts = [tokenizer(x).input_ids for x in TEXTS]
    ppl_n, ppl_q = perplexity(native, texts), perplexity(int8, texts)
    ratio = ppl_q / ppl_n
    if not failure and ratio > MAX_PPL_RATIO:
        failure = f"held-out perplexity {ppl_q:.4f} is {100 * (ratio - 1):.2f} % above the native {ppl_n:.4f}"
    return GateReport(passed=not failure, reason=failure or "passed", prompts=len(prompts), equal=equal, ties=ties,
                      worst_gap=worst, mean_equal_tokens=sum(same) / len(same), ppl_native=ppl_n, ppl_int8=ppl_q, ppl_ratio=ratio,
                      seconds=time.perf_counter() - t0)


def gate_path(home: Path, fingerprint: str, dtype: torch.dtype) -> Path:
    key = hashlib.sha256(f"{fingerprint}|{dtype}|int8-per-channel|v{GATE_VERSION}".encode()).hexdigest()[:24]
    return Path(home) / "gates" / f"decode-int8-{key}.json"


def cached_gate(path: Path, native_fn, int8, tokenizer) -> GateReport:
    """The cached report at `path`, else run the gate (`native_fn()` builds the native model) and
    cache its report atomically. A cache that does not parse is run again."""
    try:
        raw = json.loads(path.read_text())
        if raw.get("version") == GATE_VERSION:
            return GateReport(**raw)
    except (OSError, ValueError, TypeError):
        pass
    report = run_gate(native_fn(), int8, tokenizer)
    from index.durable import atomic_write
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, (json.dumps(asdict(report), indent=1) + "\n").encode())
    except OSError as exc:                      # a read-only home: the gate runs again next start
        logger.warning("could not cache the int8 gate's report at %s: %s", path, exc)
    return report

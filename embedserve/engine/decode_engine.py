"""DecodeEngine: the generation loop on its own thread.

Each step: apply queued adds/aborts, `Scheduler.schedule()`, `ModelRunner.run()`, sample,
then per sequence append the token, detokenize, check stop conditions and report. The HTTP
layer only calls `add` / `abort` and receives `GenerationEvent`s through a callback.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Callable

from kernels import check_kv_cache_dtype

from ..config import DecodeConfig
from ..errors import ConfigError, OverloadedError, UnavailableError, ValidationError
from ..metrics import Metrics
from ..models.llama import LlamaModel
from .block_manager import BlockManager
from .compute import COMPUTE_LOCK
from .model_runner import ModelRunner
from .sampler import sample
from .scheduler import Scheduler, SchedulerConfig
from .sequence import SamplingParams, Sequence, TokenLogprob
from .engine_thread import EngineThread

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class GenerationEvent:
    """New text for one request; `finish_reason` set on its last event. `logprobs` (when asked
    for) covers every token sampled since the previous event, whether or not its text is out."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None


class Detokenizer:
    """Incremental detokenization with stop strings, as vLLM does it (prefix and read offsets).

    Each step decodes only a window of the last few tokens, not the whole completion:

        completion ids   [ t0 t1 ... t7 | t8 t9 | t10 t11 ]   + new id
                           text out       context  unread
                                          `--- window (decoded) ---'

    The context tokens (prefix offset) make the window decode as it would inside the whole text
    (a SentencePiece word start, say); the unread ones (from the read offset) came since the
    text last ended on a whole character. Once it does again, the unread tokens become the next
    context. The work per token is bounded by the window: a few tokens for a character split
    over byte tokens, more only while every step ends in an invalid UTF-8 sequence.

    Text is released once complete: a trailing U+FFFD (a character still split over tokens) is
    held back, and dropped if the answer ends there; the released text is otherwise
    `decode(all ids, skip_special_tokens=True)`. It is also held back while it could become part
    of a stop string (the last `len(longest stop) - 1` characters).
    """

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tok, self.stop = tokenizer, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.skip = _skipped_ids(tokenizer)
        self.window: list[int] = []     # context tokens, then unread ones
        self.read = 0                   # window[:read] is the context
        self.out = 0                    # characters of decode(window) already decoded out
        self.pending = ""               # decoded, not yet released (could start a stop string)

    def update(self, new_ids, final: bool) -> tuple[str, bool]:
        """Take this step's new token ids (none for an EOS that ends the answer); returns (new text
        to release, hit_stop). `final`: the answer ends here, release what is held."""
        new = [t for t in new_ids if t not in self.skip]
        if new:
            self.window += new
            text = self.tok.decode(self.window, skip_special_tokens=True)
            end = len(text.rstrip("\ufffd"))
            if end > self.out:
                self.pending += text[self.out:end]
                self.out = end
            if end == len(text):                # a whole character ends the window: move it on
                self.window = self.window[self.read:]
                self.read = len(self.window)
                self.out = len(self.tok.decode(self.window, skip_special_tokens=True))
        for s in self.stop:
            k = self.pending.find(s)
            if k != -1:
                out, self.pending = self.pending[:k], ""
                return out, True
        cut = len(self.pending) if final else max(len(self.pending) - self.hold, 0)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False


@functools.lru_cache(maxsize=8)
def _skipped_ids(tokenizer) -> frozenset[int]:
    """The ids that `decode(..., skip_special_tokens=True)` drops: left out of the window before
    decoding (the same text), so a run of them (EOS under ignore_eos) does not widen it. Found by
    asking the tokenizer about each of its special and added tokens."""
    ids = set(getattr(tokenizer, "all_special_ids", ())) | set(getattr(tokenizer, "added_tokens_decoder", {}) or ())
    return frozenset(i for i in ids
                     if tokenizer.decode([i], skip_special_tokens=True) == "" and tokenizer.decode([i]) != "")


class DecodeEngine(EngineThread):
    """Continuous batching over a paged KV cache."""

    thread_name = "decode-engine"

    def __init__(self, model: LlamaModel, tokenizer, config: DecodeConfig, num_blocks: int,
                 metrics: Metrics | None = None):
        """`config` is the tree's decode section with its model length and step budget filled in
        (as the memory plan does); `num_blocks` KV blocks of `config.block_size` tokens."""
        super().__init__()
        assert config.max_model_len is not None and config.max_num_batched_tokens is not None, \
            "the memory plan fills in the model length and the configuration tree the step budget"
        if num_blocks < 1:
            raise ConfigError("the KV cache holds no block; raise --kv-cache-memory")
        config.check_model_len(config.max_model_len)
        try:
            kv_dtype = check_kv_cache_dtype(config.kv_cache_dtype, model.device, model.dtype)
        except ValueError as exc:
            raise ConfigError(f"--kv-cache-dtype: {exc}") from None
        self.model, self.tokenizer, self.config, self.num_blocks = model, tokenizer, config, num_blocks
        self.metrics = metrics or Metrics()
        self.bm = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs,
                                                   config.enable_chunked_prefill), self.bm)
        self.runner = ModelRunner(model, num_blocks, config.block_size, kv_dtype)
        self.eos = set(model.cfg.eos_token_ids)
        self._ids = itertools.count()
        self._inbox: list[tuple[str, object]] = []
        self._detok: dict[int, Detokenizer] = {}
        self._num_active = 0            # added and not yet finished, for admission control
        self._callbacks: dict[int, Callable[[GenerationEvent], None]] = {}

    # ------------------------------------------------------------ interface
    @property
    def vocab_size(self) -> int:
        return self.model.cfg.vocab_size

    def check_request(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Refuse what can never run: over --max-model-len, or more blocks than the cache has."""
        cfg = self.config
        total = num_prompt_tokens + max_tokens
        if total > cfg.max_model_len:
            raise ValidationError(f"the prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens}: "
                                  f"{total} > --max-model-len {cfg.max_model_len}; shorten the prompt or "
                                  "lower max_tokens", param="max_tokens", code="context_length_exceeded")
        if self.bm.blocks_needed(total) > self.num_blocks:
            raise ValidationError(f"{total} tokens need {self.bm.blocks_needed(total)} KV blocks; the cache "
                                  f"has {self.num_blocks}; lower max_tokens", param="max_tokens")

    def check_params(self, params: SamplingParams) -> None:
        """Refuse logit_bias ids outside the vocabulary (they would fail the whole batch's step)."""
        vocab = self.vocab_size
        bad = next((t for t in params.logit_bias or () if t >= vocab), None)
        if bad is not None:
            raise ValidationError(f"logit_bias token id {bad} is outside the vocabulary [0, {vocab}); "
                                  "use this model's token ids", param="logit_bias")

    def add(self, prompt_ids: list[int], params: SamplingParams,
            callback: Callable[[GenerationEvent], None]) -> int:
        """Queue a request; returns its id (for `abort`). Events arrive on the engine thread."""
        if not prompt_ids:
            raise ValidationError("the prompt is empty", param="prompt")
        self.check_request(len(prompt_ids), params.max_tokens)
        self.check_params(params)
        if not self.alive():
            raise UnavailableError("the generation engine is not running" + (f" ({self.death})" if self.death else ""))
        seq = Sequence(next(self._ids), list(prompt_ids), params)
        with self._cv:
            limit = 4 * self.config.max_num_seqs
            if self._num_active >= limit:
                raise OverloadedError(f"{self._num_active} generation requests in flight, the limit is {limit} "
                                      "(4 × --max-num-seqs); retry later", retry_after=2)
            self._num_active += 1
            self._inbox.append(("add", (seq, callback)))
            self._cv.notify()
        return seq.seq_id

    def abort(self, seq_id: int) -> None:
        """The client went away: the sequence is dropped and its blocks freed at the next step."""
        with self._cv:
            self._inbox.append(("abort", seq_id))
            self._cv.notify()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        """Offline batch generation on the calling thread (the engine thread must not be running):
        every prompt is queued at once and stepped to completion; returns the finished sequences."""
        seqs = self.enqueue(prompts, params)
        while self.scheduler.has_work():
            self.step()
        return seqs

    def enqueue(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        """Queue prompts for `step()` on the calling thread (the engine thread must not be running)
        without stepping them; returns their sequences (`generate` steps them to completion)."""
        assert not self.health(), "use add() while the engine thread runs"
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = []
        for ids, p in zip(prompts, plist):
            self.check_request(len(ids), p.max_tokens)
            self.check_params(p)
            seq = Sequence(next(self._ids), list(ids), p)
            self._detok[seq.seq_id] = Detokenizer(self.tokenizer, p.stop)
            self.scheduler.add(seq)
            seqs.append(seq)
        return seqs

    def stats(self) -> dict:
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "kv_usage": round(self.bm.usage(), 4), "free_blocks": self.bm.num_free_blocks,
                "prefix_hit_rate": self.bm.prefix_hits / max(self.bm.prefix_queries, 1)}

    # ------------------------------------------------------------ internals
    def _apply_inbox(self) -> None:
        with self._cv:
            items, self._inbox = self._inbox, []
        live = {s.seq_id: s for s in itertools.chain(self.scheduler.running, self.scheduler.waiting)}
        for kind, arg in items:
            if kind == "add":
                seq, cb = arg
                self._callbacks[seq.seq_id] = cb
                self._detok[seq.seq_id] = Detokenizer(self.tokenizer, seq.params.stop)
                self.scheduler.add(seq)
                live[seq.seq_id] = seq
            elif arg in live:
                self._finish(live.pop(arg), "abort", emit=False)

    def _loop(self) -> None:
        while True:
            with self._cv:
                idle = not self._stop and not self._inbox and not self.scheduler.has_work()
            if idle:
                COMPUTE_LOCK.idle()             # nothing to run: this thread's OpenMP team goes
            with self._cv:
                while not self._stop and not self._inbox and not self.scheduler.has_work():
                    self._cv.wait()
                if self._stop:
                    return
            self._apply_inbox()
            if not self.scheduler.has_work():
                self._update_gauges()
                continue
            try:
                self.step()
            except Exception:
                logger.exception("generation step failed; failing its sequences")
                for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
                    self._finish(seq, "error")

    def step(self) -> None:
        """One scheduling step: forward, sample, postprocess."""
        m = self.metrics
        sched = self.scheduler.schedule()
        if sched.preempted:
            m.gen_preemptions.inc(len(sched.preempted))
        if not sched.scheduled:
            return
        with COMPUTE_LOCK, self.busy():
            seqs, logits = self.runner.run(sched)
            tokens, logprobs = sample(logits, seqs) if seqs else ([], [])
        now = time.monotonic()
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n
            self.bm.mark_computed(seq)
            if seq.num_computed_tokens == seq.num_prompt_tokens and seq.first_token_time is None:
                m.gen_prompt_tokens.inc(seq.num_prompt_tokens)
        for seq, tok, lp in zip(seqs, tokens, logprobs):
            seq.token_ids.append(tok)
            if lp is not None:
                seq.pending_logprobs.append(lp)
            if seq.first_token_time is None:
                seq.first_token_time = now
                m.gen_ttft.observe(now - seq.arrival)
            elif seq.last_token_time is not None:
                m.gen_itl.observe(now - seq.last_token_time)
            seq.last_token_time = now
            m.gen_tokens.inc()
            p = seq.params
            reason = None
            if tok in self.eos and not p.ignore_eos:
                reason = "stop"
            elif seq.num_completion_tokens >= p.max_tokens:
                reason = "length"
            new = () if reason == "stop" and tok in self.eos else (tok,)       # the EOS is no text
            text, hit = self._detok[seq.seq_id].update(new, final=reason is not None)
            if hit:
                reason = "stop"
            if reason:
                self._finish(seq, reason, text=text)
            elif text:
                self._emit(seq, GenerationEvent(text, [tok], logprobs=self._take_logprobs(seq)))
        self._update_gauges()

    def _update_gauges(self) -> None:
        m = self.metrics
        m.gen_running.set(len(self.scheduler.running))
        m.gen_waiting.set(len(self.scheduler.waiting))
        m.gen_kv_usage.set(self.bm.usage())
        m.gen_prefix_queries.set(self.bm.prefix_queries)
        m.gen_prefix_hits.set(self.bm.prefix_hits)

    def _emit(self, seq: Sequence, ev: GenerationEvent) -> None:
        cb = self._callbacks.get(seq.seq_id)
        if cb is not None:
            cb(ev)

    @staticmethod
    def _take_logprobs(seq: Sequence) -> list[TokenLogprob] | None:
        if seq.params.logprobs is None:
            return None
        out, seq.pending_logprobs = seq.pending_logprobs, []
        return out

    def _on_death(self, exc: BaseException) -> None:
        """The loop died: every sequence it held (and any still in the inbox) ends with "error"."""
        self._apply_inbox()
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            self._finish(seq, "error")

    def _finish(self, seq: Sequence, reason: str, text: str = "", emit: bool = True) -> None:
        self.scheduler.finish(seq, reason)
        if seq.seq_id in self._callbacks:
            with self._cv:
                self._num_active -= 1
        if emit:
            self.metrics.gen_e2e.observe(time.monotonic() - seq.arrival)
            self._emit(seq, GenerationEvent(text, [], reason, seq.num_prompt_tokens,
                                            len(seq.completion_ids), seq.num_cached_tokens,
                                            self._take_logprobs(seq)))
        self._callbacks.pop(seq.seq_id, None)
        self._detok.pop(seq.seq_id, None)

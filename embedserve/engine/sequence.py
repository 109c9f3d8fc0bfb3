"""A generation request as the decode engine sees it: token ids, counters, block table."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

import torch

from ..errors import ValidationError

MAX_LOGPROBS = 20                   # top logprobs per token, as vLLM's default --max-logprobs


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class SamplingParams:
    """OpenAI-style sampling settings, validated on construction."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                  # 0: off
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0       # OpenAI's: subtracted once from every token already generated
    frequency_penalty: float = 0.0      # OpenAI's: subtracted once per earlier occurrence in the output
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit, in [-100, 100]
    logprobs: int | None = None         # None: no logprobs; k: the chosen token's and the top k (k <= 20)

    def __post_init__(self):
        if not 0 <= self.temperature <= 2:
            raise ValidationError(f"temperature {self.temperature} is outside [0, 2]", param="temperature")
        if not 0 < self.top_p <= 1:
            raise ValidationError(f"top_p {self.top_p} is outside (0, 1]", param="top_p")
        if self.top_k < 0:
            raise ValidationError(f"top_k {self.top_k} must be >= 0 (0 turns it off)", param="top_k")
        if self.max_tokens < 1:
            raise ValidationError(f"max_tokens {self.max_tokens} must be >= 1", param="max_tokens")
        if len(self.stop) > 4 or any(not s for s in self.stop):
            raise ValidationError("stop takes at most 4 non-empty strings", param="stop")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValidationError(f"{name} {getattr(self, name)} is outside [-2, 2]", param=name)
        if self.logit_bias:
            self.logit_bias = {_token_id(k): _bias(k, v) for k, v in self.logit_bias.items()}
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValidationError(f"logprobs {self.logprobs} is outside [0, {MAX_LOGPROBS}]", param="logprobs")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def processes_logits(self) -> bool:
        """Whether the logits change before sampling (bias or penalties)."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty)


def _token_id(key: int | str) -> int:
    """A logit_bias key: a token id, as an int or (JSON's object keys) a decimal string."""
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    raise ValidationError(f"logit_bias key {key!r} is not a token id; use token ids such as \"50256\"",
                          param="logit_bias")


def _bias(key: int | str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
        raise ValidationError(f"logit_bias[{key!r}] = {value!r} is outside [-100, 100]", param="logit_bias")
    return float(value)


@dataclass(slots=True)
class TokenLogprob:
    """One generated token's log-probability and the `top` most likely (id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class Sequence:
    """Prompt + generated tokens; `num_computed_tokens` catches up with `num_tokens` step by step."""

    seq_id: int
    token_ids: list[int]
    params: SamplingParams
    on_output: Callable[["Sequence", list[int], bool], None] = lambda s, t, f: None
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0          # prompt tokens served from the prefix cache at admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)   # hashes of computed full blocks
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)  # sampled, not yet reported

    def __post_init__(self):
        self.num_prompt_tokens = len(self.token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def completion_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_completion_tokens(self) -> int:
        """len(completion_ids) without copying them."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

"""A generation request as the decode engine sees it: token ids, counters, block table."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

import torch

from ..errors import ValidationError


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


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
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

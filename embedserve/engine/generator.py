"""A served decoder as the API sees it: a name, prompt encoding, and the engine's narrow
interface (`add`, `abort`, `health`). Routes never reach into the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..metrics import Metrics
from .decode_engine import DecodeEngine, GenerationEvent
from .sequence import SamplingParams


@dataclass
class Generator:
    """A loaded decoder: its served name, engine and tokenizer."""

    name: str
    engine: DecodeEngine
    tokenizer: Any
    gate: dict | None = None        # the int8 accuracy gate's report where --decode-weights auto ran it

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a completion prompt (with the tokenizer's own specials)."""
        return list(self.tokenizer(text).input_ids)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a chat under the model's chat template, ready for the assistant's turn."""
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token id decoded on its own, special tokens included (for logprobs)."""
        return self.tokenizer.batch_decode([[i] for i in ids])

    def add(self, prompt_ids: list[int], params: SamplingParams,
            callback: Callable[[GenerationEvent], None]) -> int:
        return self.engine.add(prompt_ids, params, callback)

    def abort(self, seq_id: int) -> None:
        self.engine.abort(seq_id)

    def health(self) -> bool:
        return self.engine.health()

    def health_problem(self) -> str | None:
        return self.engine.health_problem()

    def start(self, metrics: Metrics | None = None) -> None:
        """Start the engine thread, reporting into `metrics` (the server's registry)."""
        if metrics is not None:
            self.engine.metrics = metrics
        self.engine.start()

    def stop(self) -> None:
        self.engine.stop()

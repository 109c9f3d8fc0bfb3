"""One token budget per step, running sequences first (vLLM v1 shape).

There is no separate prefill or decode phase: each scheduled sequence gets the tokens it
still has to compute (`num_tokens - num_computed_tokens`: 1 when decoding, the rest of its
prompt when prefilling), cut to what is left of the budget when chunked prefill is on.
When a running sequence cannot get a block, the newest running sequence is preempted
(its blocks freed, to be recomputed later).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterator

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)   # (sequence, tokens this step)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class SeqQueue:
    """Sequences in order, with O(1) append and pop at either end and O(1) removal from the
    middle (a finished or aborted sequence): an ordered dict used as an ordered set."""

    __slots__ = ("_seqs",)

    def __init__(self):
        self._seqs: OrderedDict[Sequence, None] = OrderedDict()

    def append(self, seq: Sequence) -> None:
        self._seqs[seq] = None

    def appendleft(self, seq: Sequence) -> None:
        self._seqs[seq] = None
        self._seqs.move_to_end(seq, last=False)

    def pop(self) -> Sequence:
        return self._seqs.popitem(last=True)[0]

    def popleft(self) -> Sequence:
        return self._seqs.popitem(last=False)[0]

    def first(self) -> Sequence:
        return next(iter(self._seqs))

    def remove(self, seq: Sequence) -> None:
        del self._seqs[seq]

    def __contains__(self, seq: object) -> bool:
        return seq in self._seqs

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._seqs)

    def __len__(self) -> int:
        return len(self._seqs)


class Scheduler:
    """Waiting and running queues over a BlockManager."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.bm = block_manager
        self.waiting = SeqQueue()
        self.running = SeqQueue()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        cfg, bm = self.config, self.bm
        out = SchedulerOutput()
        budget = cfg.max_num_batched_tokens
        # preemption pops from the tail of `running`, which is the tail of this snapshot: the
        # first `end` entries are the ones still running
        order, end = list(self.running), len(self.running)
        i = 0
        while i < end and budget > 0:
            seq = order[i]
            n = seq.num_tokens - seq.num_computed_tokens
            if n > budget:
                if not cfg.enable_chunked_prefill:
                    i += 1
                    continue
                n = budget
            while not bm.can_append(seq, n):
                victim = self.running.pop()
                end -= 1
                assert victim is order[end]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                bm.may_append(seq, n)
                out.scheduled.append((seq, n))
                budget -= n
                i += 1
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs and not out.preempted:
            seq = self.waiting.first()
            if not bm.can_allocate(seq):
                break
            bm.allocate(seq)
            n = seq.num_tokens - seq.num_computed_tokens
            if n > budget and not cfg.enable_chunked_prefill:
                bm.deallocate(seq)          # keeps its blocks cached for the next try
                break
            n = min(n, budget)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
        assert out.num_tokens <= cfg.max_num_batched_tokens
        assert len(self.running) <= cfg.max_num_seqs
        assert all(n >= 1 for _, n in out.scheduled)
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.bm.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (stopped, length, or aborted) and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_table:
            self.bm.deallocate(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

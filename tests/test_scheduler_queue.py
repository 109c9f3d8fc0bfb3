"""The scheduler's queues: an ordered set with O(1) removal from the middle that behaves as the
list / deque it replaces, and preemption that still takes the newest running sequence first."""

import random
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from embedserve.engine.block_manager import BlockManager
from embedserve.engine.scheduler import Scheduler, SchedulerConfig, SeqQueue
from embedserve.engine.sequence import SamplingParams, Sequence, SequenceStatus


def _seq(i: int, n: int = 4) -> Sequence:
    return Sequence(i, [i] * n, SamplingParams(temperature=0, max_tokens=8))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["append", "appendleft", "pop", "popleft", "remove"]),
                          st.integers(0, 10**6)), max_size=80))
def test_seq_queue_behaves_as_a_list(ops):
    q, model, seqs = SeqQueue(), [], iter(_seq(i) for i in range(10**6))
    for op, r in ops:
        if op in ("append", "appendleft"):
            s = next(seqs)
            getattr(q, op)(s)
            model.append(s) if op == "append" else model.insert(0, s)
        elif not model:
            continue
        elif op == "pop":
            assert q.pop() is model.pop()
        elif op == "popleft":
            assert q.popleft() is model.pop(0)
        else:
            s = model.pop(r % len(model))
            q.remove(s)
            assert s not in q
        assert list(q) == model and len(q) == len(model) and bool(q) == bool(model)
        if model:
            assert q.first() is model[0] and model[-1] in q


def test_removal_from_the_middle_does_not_scan():
    # 20,000 removals from a 100,000-sequence queue: ~10^9 comparisons for a list, milliseconds here
    seqs = [_seq(i, 1) for i in range(100_000)]
    q = SeqQueue()
    for s in seqs:
        q.append(s)
    gone = random.Random(0).sample(seqs, 20_000)
    left = set(seqs) - set(gone)
    t0 = time.perf_counter()
    for s in gone:
        q.remove(s)
    assert time.perf_counter() - t0 < 2.0
    assert len(q) == 80_000 and list(q) == [s for s in seqs if s in left]


def test_preemption_takes_the_newest_running_sequence_and_requeues_it_first():
    bm = BlockManager(4, 4, False)
    sched = Scheduler(SchedulerConfig(64, 8, True), bm)
    a, b, c = _seq(0), _seq(1), _seq(2)
    for s in (a, b, c):
        sched.add(s)
    out = sched.schedule()                          # three 4-token prompts: one block each
    assert [s for s, _ in out.scheduled] == [a, b, c] and list(sched.running) == [a, b, c]
    for s, n in out.scheduled:
        s.num_computed_tokens += n
        s.token_ids.append(99)                      # each now needs a second block; one is free
    out = sched.schedule()
    assert out.preempted == [c], "the newest is preempted, in favour of the older b"
    assert [s for s, _ in out.scheduled] == [a, b]
    assert list(sched.running) == [a, b] and sched.waiting.first() is c and c.status is SequenceStatus.WAITING
    sched.finish(a, "length")                        # retiring from the front keeps the order
    assert list(sched.running) == [b] and a.is_finished
    sched.finish(c, "abort")                         # and an abort while waiting
    assert not sched.waiting and bm.num_free_blocks == 2

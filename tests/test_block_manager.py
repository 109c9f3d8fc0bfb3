"""Property tests of the block manager and scheduler (no model: a fake step advances counters).

Under any interleaving of add / step / abort / finish: no block is leaked or owned twice,
reference counts equal the number of live sequences holding each block, the step's token
budget and sequence limit hold, and once every sequence has ended all blocks are free.
"""

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from embedserve.engine.block_manager import BlockManager
from embedserve.engine.scheduler import Scheduler, SchedulerConfig
from embedserve.engine.sequence import SamplingParams, Sequence, SequenceStatus


def _check_invariants(bm: BlockManager, sched: Scheduler) -> None:
    live = list(sched.running) + [s for s in sched.waiting if s.block_table]
    owners = Counter(b for s in live for b in s.block_table)
    for s in live:
        assert len(set(s.block_table)) == len(s.block_table), "a sequence holds a block twice"
    for b in bm.blocks:
        assert b.ref_count == owners.get(b.block_id, 0), f"block {b.block_id} ref count {b.ref_count}"
        assert (b.ref_count == 0) == (b.block_id in bm.free), f"block {b.block_id} free-list state"
    for h, bid in bm.hash_to_block.items():
        assert bm.blocks[bid].hash == h
    # a sequence never computes past its tokens, and holds the slots for what it computed
    for s in sched.running:
        assert s.num_computed_tokens <= s.num_tokens
        assert len(s.block_table) * bm.block_size >= s.num_computed_tokens


def _fake_step(sched: Scheduler, bm: BlockManager, out, rng_tokens):
    for seq, n in out.scheduled:
        seq.num_computed_tokens += n
        bm.mark_computed(seq)
    for seq, n in out.scheduled:
        if seq.num_computed_tokens == seq.num_tokens and seq.status is SequenceStatus.RUNNING:
            seq.token_ids.append(next(rng_tokens))
            if len(seq.completion_ids) >= seq.params.max_tokens:
                sched.finish(seq, "length")


ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 70), st.integers(1, 12), st.integers(0, 2)),
    st.tuples(st.just("step")), st.tuples(st.just("step")), st.tuples(st.just("step")),
    st.tuples(st.just("abort"), st.integers(0, 30)),
), min_size=1, max_size=60)


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(6, 40), st.sampled_from([4, 8, 16]), st.integers(8, 96), st.integers(1, 6),
       st.booleans(), st.booleans())
def test_no_leak_no_double_ownership_budget_holds(ops, num_blocks, block_size, budget, max_seqs,
                                                   prefix_caching, chunked):
    bm = BlockManager(num_blocks, block_size, prefix_caching)
    sched = Scheduler(SchedulerConfig(budget, max_seqs, chunked), bm)
    seqs: list[Sequence] = []
    tokens = iter(range(10**9))
    shared = [7] * 40                                   # a common prefix to exercise cache hits
    for op in ops:
        if op[0] == "add":
            _, plen, max_tokens, kind = op
            prompt = (shared[:plen] if kind == 0 else [kind] * plen)[:plen] + [plen % 5] * max(0, plen - 40)
            if bm.blocks_needed(len(prompt) + max_tokens) > num_blocks or (
                    not chunked and len(prompt) + max_tokens > budget):
                continue                               # the engine refuses these up front
            seq = Sequence(len(seqs), prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
            seqs.append(seq)
            sched.add(seq)
        elif op[0] == "step":
            out = sched.schedule()
            assert out.num_tokens <= budget
            assert len(sched.running) <= max_seqs
            assert len({id(s) for s, _ in out.scheduled}) == len(out.scheduled)
            _check_invariants(bm, sched)
            _fake_step(sched, bm, out, tokens)
        else:
            if seqs:
                seq = seqs[op[1] % len(seqs)]
                if not seq.is_finished:
                    sched.finish(seq, "abort")
        _check_invariants(bm, sched)
    # drain: everything still alive must finish, then every block is free again
    for _ in range(10_000):
        if not sched.has_work():
            break
        out = sched.schedule()
        assert out.scheduled or out.preempted, "the scheduler stalled with work left"
        _fake_step(sched, bm, out, tokens)
        _check_invariants(bm, sched)
    assert not sched.has_work()
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_prefix_hit_shares_blocks_and_leaves_last_token_to_compute():
    bm = BlockManager(16, 4, True)
    a = Sequence(0, list(range(12)), SamplingParams(temperature=0))
    bm.allocate(a)
    a.num_computed_tokens = 12
    bm.mark_computed(a)
    b = Sequence(1, list(range(12)), SamplingParams(temperature=0))      # identical prompt
    assert bm.can_allocate(b)
    bm.allocate(b)
    assert b.num_cached_tokens == 8, "a full hit still recomputes the last block's tokens"
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    c = Sequence(2, list(range(8)) + [99, 98, 97, 96, 95], SamplingParams(temperature=0))
    bm.allocate(c)
    assert c.num_cached_tokens == 8
    for s in (a, b, c):
        bm.deallocate(s)
    assert bm.num_free_blocks == 16


def test_freed_cached_blocks_are_revived_then_evicted_lru():
    bm = BlockManager(4, 4, True)
    a = Sequence(0, list(range(9)), SamplingParams(temperature=0))
    bm.allocate(a)
    a.num_computed_tokens = 9
    bm.mark_computed(a)
    cached = list(a.block_table[:2])
    bm.deallocate(a)
    assert len(bm.hash_to_block) == 2                  # kept for reuse while free
    b = Sequence(1, list(range(9)), SamplingParams(temperature=0))
    bm.allocate(b)
    assert b.block_table[:2] == cached and b.num_cached_tokens == 8
    bm.deallocate(b)
    # a different 16-token prompt needs all 4 blocks: every cached block is evicted
    c = Sequence(2, [50 + i for i in range(16)], SamplingParams(temperature=0))
    bm.allocate(c)
    assert not bm.hash_to_block


def test_blocks_with_uncomputed_kv_never_hit():
    """A block enters the prefix cache only after its K/V were computed."""
    bm = BlockManager(16, 4, True)
    a = Sequence(0, list(range(12)), SamplingParams(temperature=0))
    bm.allocate(a)
    b = Sequence(1, list(range(12)), SamplingParams(temperature=0))
    bm.allocate(b)
    assert b.num_cached_tokens == 0

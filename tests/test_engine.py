"""The token-budget queue and the embed engine: batch limits, order, cancellation, overload."""

import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedserve.api.errors import status_for
from embedserve.config import EmbedConfig
from embedserve.engine.embed_engine import EmbedEngine
from embedserve.engine.batch_queue import EmbedRequest, RequestStatus, TokenBudgetQueue
from embedserve.errors import OverloadedError, ValidationError


def _req(lengths, on_done=lambda r: None):
    return EmbedRequest(inputs=[[7] * n for n in lengths], want=frozenset({"dense"}), on_done=on_done)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(1, 64), min_size=1, max_size=8), min_size=1, max_size=12),
       st.integers(64, 300), st.integers(1, 16), st.sets(st.integers(0, 11)))
def test_batches_respect_budget_keep_fifo_and_drop_cancelled(reqs, budget, max_size, cancel):
    q = TokenBudgetQueue()
    requests = [_req(r) for r in reqs]
    for r in requests:
        q.append(r)
    for i in cancel:
        if i < len(requests):
            requests[i].status = RequestStatus.CANCELLED
    seen, dropped_total = [], 0
    while len(q):
        batch, dropped = q.next_batch(budget, max_size)
        dropped_total += dropped
        assert sum(e.num_tokens for e in batch) <= budget
        assert len(batch) <= max_size
        assert len(batch) > 0 or dropped > 0 or not len(q)
        seen += [(requests.index(e.request), e.index) for e in batch]
    expected = [(i, j) for i, r in enumerate(reqs) if i not in cancel for j in range(len(r))]
    assert seen == expected, "entries must leave in arrival order, each once"
    assert dropped_total == sum(len(r) for i, r in enumerate(reqs) if i in cancel)
    assert q.num_tokens == 0


class Slow:
    """The real MiniLM, recording each batch's input lengths and taking `delay` seconds more per
    batch (a slow model, so requests queue behind it)."""

    def __init__(self, model, delay=0.0):
        self.model, self.delay, self.batches = model, delay, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def embed(self, batch, want):
        self.batches.append([len(x) for x in batch])
        time.sleep(self.delay)
        return self.model.embed(batch, want)


def _engine(model, **kw):
    # budgets below the model's 512 tokens: the longest input is what one batch holds
    kw.setdefault("max_input_length", min(kw["max_batch_tokens"], model.max_input_length))
    eng = EmbedEngine(model, EmbedConfig(**kw))
    eng.start()
    return eng


def test_real_model_request_spreads_over_batches_and_equals_each_input_alone(minilm_model):
    """A request larger than the budget, with the real MiniLM (fp32): every batch within the
    budget and the batch size, outputs in request order and equal to each input embedded on its own."""
    model = Slow(minilm_model)
    ids = minilm_model.tokenize([f"Sentence {i} about the river " + "and the sea " * i for i in range(20)])
    eng = _engine(model, max_batch_tokens=128, max_batch_size=4, max_queued_tokens=10_000)
    done = threading.Event()
    r = EmbedRequest(inputs=ids, want=frozenset({"dense"}), on_done=lambda r: done.set())
    eng.submit(r)
    assert done.wait(60)
    eng.stop()
    assert len(model.batches) > 1 and all(sum(b) <= 128 and len(b) <= 4 for b in model.batches)
    assert r.status is RequestStatus.FINISHED
    for i, out in enumerate(r.outputs):
        alone = minilm_model.embed([ids[i]], {"dense"})[0][0].dense
        np.testing.assert_allclose(out.dense, alone, atol=1e-5)


def test_overload_is_refused_with_retry_after(minilm_model):
    model = Slow(minilm_model, delay=0.3)
    eng = _engine(model, max_batch_tokens=64, max_batch_size=8, max_queued_tokens=128,
                  max_concurrent_requests=3)
    eng.submit(_req([60]))
    time.sleep(0.05)   # first request is running; the next ones queue
    eng.submit(_req([60]))
    eng.submit(_req([60]))
    with pytest.raises(OverloadedError) as exc:
        eng.submit(_req([10]))
    assert exc.value.retry_after >= 1 and status_for(exc.value)[0] == 429
    eng.stop()


def test_queued_tokens_limit(minilm_model):
    model = Slow(minilm_model, delay=0.3)
    eng = _engine(model, max_batch_tokens=64, max_batch_size=8, max_queued_tokens=100)
    eng.submit(_req([50]))
    time.sleep(0.05)
    eng.submit(_req([50, 40]))
    with pytest.raises(OverloadedError, match="max-queued-tokens"):
        eng.submit(_req([20]))
    eng.stop()


def test_input_over_batch_budget_is_a_validation_error(minilm_model):
    eng = _engine(Slow(minilm_model), max_batch_tokens=64, max_queued_tokens=1000)
    with pytest.raises(ValidationError, match="input 1 has 65 tokens"):
        eng.submit(_req([3, 65]))
    eng.stop()


def test_cancelled_request_never_reaches_the_model(minilm_model):
    model = Slow(minilm_model, delay=0.3)
    eng = _engine(model, max_batch_tokens=64, max_batch_size=1, max_queued_tokens=1000)
    first = _req([5])
    eng.submit(first)
    time.sleep(0.05)
    doomed = EmbedRequest(inputs=[[9] * 33, [9] * 34], want=frozenset({"dense"}), on_done=lambda r: None)
    eng.submit(doomed)
    eng.abort(doomed)
    time.sleep(0.6)
    eng.stop()
    assert [33] not in model.batches and [34] not in model.batches
    assert eng.metrics.dropped._value.get() == 2


def test_model_failure_fails_the_batch_not_the_engine(minilm_model):
    class Flaky(Slow):
        def embed(self, batch, want):
            if any(x[0] == 13 for x in batch):
                raise RuntimeError("boom")
            return super().embed(batch, want)

    eng = _engine(Flaky(minilm_model), max_batch_tokens=64, max_batch_size=1, max_queued_tokens=1000)
    results = []
    bad = EmbedRequest(inputs=[[13, 13]], want=frozenset({"dense"}), on_done=results.append)
    good = EmbedRequest(inputs=[[1, 1]], want=frozenset({"dense"}), on_done=results.append)
    eng.submit(bad)
    eng.submit(good)
    deadline = time.time() + 5
    while len(results) < 2 and time.time() < deadline:
        time.sleep(0.01)
    assert eng.health()
    eng.stop()
    assert bad.error is not None and good.error is None
    np.testing.assert_allclose(good.outputs[0].dense, minilm_model.embed([[1, 1]], {"dense"})[0][0].dense, atol=1e-5)

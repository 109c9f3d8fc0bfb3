"""Incremental detokenization on the real SmolLM2 tokenizer: token by token it releases exactly
`decode(all ids)` (up to a stop string), holding back a character split over byte tokens and
dropping it if the answer ends there; and no answer of the real model, streamed or not, whatever
its finish reason, holds a U+FFFD."""

import functools
import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from embedserve.engine.decode_engine import Detokenizer

GEN = "SmolLM2-135M-Instruct"
FFFD = "\ufffd"

TEXTS = {
    "cjk": ["北京是中华人民共和国的首都。", "量子计算利用叠加和纠缠等量子力学现象", "为英文紊腱安印越。",
            "東京タワーは赤い。", "안녕하세요, 세계!", "龘靐齉爩"],
    "emoji": ["😀👍🏽🇫🇷👨‍👩‍👧 ✨🔥", "I ❤️ tea 🍵!"],
    "ascii": ["The quick brown fox jumps over the lazy dog.", "def f(x):\n    return x  # ok", "1, 2, 3, 4"],
}


@functools.cache
def tokenizer():
    from transformers import AutoTokenizer

    from embedserve.models.registry import resolve_generate_model
    return AutoTokenizer.from_pretrained(str(resolve_generate_model(GEN)[1]))


@functools.cache
def pools() -> dict[str, list[int]]:
    """Token ids by kind: CJK and emoji (characters split over byte-level tokens), ASCII,
    byte tokens (a lone UTF-8 lead or continuation byte: U+FFFD on its own), special tokens."""
    tok = tokenizer()
    out = {kind: sorted({i for t in texts for i in tok(t).input_ids}) for kind, texts in TEXTS.items()}
    out["byte"] = [i for i in range(len(tok)) if FFFD in tok.decode([i])]
    out["special"] = sorted(set(tok.all_special_ids) | set(tok.added_tokens_decoder))
    return out


def token_ids():
    kinds = st.sampled_from(["cjk", "cjk", "emoji", "ascii", "byte", "byte", "special", "any"])
    return kinds.flatmap(lambda k: st.integers(0, len(tokenizer()) - 1) if k == "any"
                         else st.sampled_from(pools()[k]))


def expected(ids: list[int], stop: tuple[str, ...]) -> tuple[str, bool]:
    """What the whole answer must be, from full decodes only: the first step whose text (without a
    trailing U+FFFD) holds a stop string ends it there (stop strings tried in order); else the full
    decode without its trailing U+FFFD."""
    tok = tokenizer()
    for t in range(1, len(ids) + 1):
        text = tok.decode(ids[:t], skip_special_tokens=True).rstrip(FFFD)
        for s in stop:
            if (k := text.find(s)) != -1:
                return text[:k], True
    return tok.decode(ids, skip_special_tokens=True).rstrip(FFFD), False


def run(ids: list[int], stop: tuple[str, ...], eos_end: bool) -> tuple[str, bool, list[str]]:
    """Feed `ids` one at a time as the engine does (the last with final=True, or an EOS after
    them: final with no new id); returns (the answer, hit a stop string, each step's release)."""
    d, steps = Detokenizer(tokenizer(), stop), []
    feed = [([i], False) for i in ids] + [((), True)] if eos_end else \
        [([i], k == len(ids) - 1) for k, i in enumerate(ids)]
    for new, final in feed:
        text, hit = d.update(new, final)
        steps.append(text)
        if hit:
            return "".join(steps), True, steps
    return "".join(steps), False, steps


SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.lists(token_ids(), min_size=1, max_size=40), st.booleans())
def test_incremental_equals_full_decode(ids, eos_end):
    tok = tokenizer()
    answer, hit, steps = run(ids, (), eos_end)
    assert not hit
    assert answer == tok.decode(ids, skip_special_tokens=True).rstrip(FFFD)
    # and nothing is held longer than a split character: after each step the text out so far is
    # the full decode of the ids so far, less a trailing U+FFFD
    for t in range(1, len(ids)):
        assert "".join(steps[:t]) == tok.decode(ids[:t], skip_special_tokens=True).rstrip(FFFD)


@SETTINGS
@given(st.lists(token_ids(), min_size=1, max_size=30), st.data(), st.booleans())
def test_stop_strings_cut_where_a_full_decode_would(ids, data, eos_end):
    text = tokenizer().decode(ids, skip_special_tokens=True)
    # stop strings taken from the text itself (so they hit), across split characters too, and made-up ones
    pieces = st.one_of(st.integers(0, max(len(text) - 1, 0)).flatmap(
        lambda a: st.integers(a + 1, min(a + 6, max(len(text), a + 1))).map(lambda b: text[a:b])),
        st.sampled_from(["。", "\n", " the", "😀", "好", "!", "xyzzy"]))
    stop = tuple(s for s in data.draw(st.lists(pieces, min_size=1, max_size=4)) if s and FFFD not in s)
    answer, hit, steps = run(ids, stop, eos_end)
    assert (answer, hit) == expected(ids, stop)
    if stop:
        hold = max(map(len, stop)) - 1
        for t in range(1, len(steps) - (not hit)):    # before the end, exactly the last `hold` held
            full = tokenizer().decode(ids[:t], skip_special_tokens=True).rstrip(FFFD)
            assert "".join(steps[:t]) == full[:max(len(full) - hold, 0)]


def test_a_character_cut_by_the_end_is_dropped_not_replaced():
    tok = tokenizer()
    ids = tok("为英文紊腱安印越。好").input_ids
    assert tok.decode(ids[:-1]).endswith(FFFD), "好 is split over two byte-level tokens"
    assert run(ids[:-1], (), False)[0] == "为英文紊腱安印越。"
    assert run(ids[:-1], (), True)[0] == "为英文紊腱安印越。"
    assert run(ids, (), False)[0] == "为英文紊腱安印越。好"


def test_work_per_token_is_a_window_not_the_whole_text(monkeypatch):
    tok = tokenizer()
    lengths = []
    real = type(tok).decode

    def spy(self, ids, *a, **k):
        lengths.append(len(ids))
        return real(self, ids, *a, **k)
    ids = tok("量子计算利用叠加和纠缠等量子力学现象。 The quick brown fox 😀. " * 20).input_ids
    d = Detokenizer(tok, ("never",))
    monkeypatch.setattr(type(tok), "decode", spy)
    out = "".join(d.update([i], False)[0] for i in ids[:-1]) + d.update(ids[-1:], True)[0]
    monkeypatch.undo()
    assert out == tok.decode(ids, skip_special_tokens=True)
    assert len(ids) > 500 and max(lengths) <= 8 and len(lengths) <= 2 * len(ids)


def test_runs_of_special_tokens_do_not_widen_the_window(monkeypatch):
    # EOS after EOS (ignore_eos) in the middle of a split character: skipped before decoding
    tok = tokenizer()
    eos = tok.eos_token_id
    hi, good = tok("Hi").input_ids, tok("好").input_ids
    assert len(good) == 2
    lengths = []
    real = type(tok).decode
    monkeypatch.setattr(type(tok), "decode", lambda self, ids, *a, **k: lengths.append(len(ids)) or real(self, ids, *a, **k))
    d = Detokenizer(tok, ())
    out = [d.update([i], False)[0] for i in hi + good[:1] + [eos] * 300 + good[1:]]
    monkeypatch.undo()
    assert "".join(out) == "Hi好" and max(lengths) <= 3


# ---------------------------------------------------------------- the real model through the API

@pytest.fixture(scope="module")
def gen_client(smollm2, minilm_model):
    from fastapi.testclient import TestClient

    from helpers import make_decode_engine
    from embedserve.config import ServerConfig
    from embedserve.engine.generator import Generator
    from embedserve.serve import build_app
    eng = make_decode_engine(smollm2, num_blocks=256, max_model_len=1024)
    app = build_app(ServerConfig.of(model="all-MiniLM-L6-v2"),
                    model=minilm_model, generator=Generator(name=GEN, engine=eng, tokenizer=smollm2[1]))
    with TestClient(app) as c:
        yield c


PROMPTS = ["Say hello in Chinese.", "用中文写一首关于月亮的短诗。", "请用一句话介绍北京。", "Write three emoji."]


@pytest.mark.parametrize("stream", [False, True])
def test_no_answer_of_the_real_model_holds_a_replacement_character(gen_client, stream):
    reasons = set()
    for n, prompt in enumerate(PROMPTS):
        for seed in range(4):
            body = {"model": GEN, "messages": [{"role": "user", "content": prompt}], "seed": seed,
                    "temperature": 1.0, "max_tokens": 3 + (5 * seed + n) % 18, "stream": stream}
            if seed == 3:                   # long enough to end on a stop string or EOS
                body.update(max_tokens=48, stop=["。", "，", "\n", "!"])
            text, reason = _chat(gen_client, body)
            assert FFFD not in text, (prompt, seed, text)
            reasons.add(reason)
    assert reasons == {"length", "stop"}, reasons


def _chat(c, body) -> tuple[str, str]:
    if not body["stream"]:
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        return ch["message"]["content"], ch["finish_reason"]
    with c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [ch["choices"][0] for ch in chunks if ch["choices"]]
    assert all(FFFD not in d["delta"].get("content", "") for d in deltas)
    return "".join(d["delta"].get("content") or "" for d in deltas), deltas[-1]["finish_reason"]

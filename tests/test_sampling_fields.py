"""OpenAI's output-changing fields on /v1/completions and /v1/chat/completions: logit_bias,
presence / frequency penalties and logprobs are honoured (the sampler against hand-computed
values, the real server against the fp32 Hugging Face reference); every other field that would
change the output, and every unknown field, is refused by name with a 400, never ignored."""

import json
import math

import httpx
import openai
import pytest
import torch

from embedserve.engine.sampler import process_logits, sample, token_logprobs
from embedserve.engine.sequence import SamplingParams, Sequence
from embedserve.errors import ValidationError

GEN = "SmolLM2-135M-Instruct"
# Our paged attention and HF's eager path sum in different orders in fp32; logprobs agree to
# about 1e-4, as in test_generate_equivalence's tie threshold.
LOGPROB_TOL = 1e-3


def _seq(generated=(), prompt=(0,), **params) -> Sequence:
    seq = Sequence(0, list(prompt), SamplingParams(**params))
    seq.token_ids += list(generated)
    return seq


# ---------------------------------------------------------------- the sampler, by hand


def test_logit_bias_moves_the_greedy_choice():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    assert sample(logits, [_seq(temperature=0)])[0] == [1]
    assert sample(logits, [_seq(temperature=0, logit_bias={"2": 1.5})])[0] == [2]      # 3.5 > 3
    assert sample(logits, [_seq(temperature=0, logit_bias={1: -100})])[0] == [2]
    assert logits.tolist() == [[1.0, 3.0, 2.0]], "the model's logits are not changed in place"


def test_logit_bias_also_steers_sampling():
    logits = torch.zeros(1, 50)
    seqs = [_seq(temperature=1.0, seed=s, logit_bias={"7": 100}) for s in range(5)]
    assert {sample(logits, [s])[0][0] for s in seqs} == {7}


def test_penalties_subtract_openai_formula_over_generated_tokens_only():
    # prompt holds token 2, output holds 1 twice and 3 once: only 1 and 3 are penalized
    seq = _seq(generated=[1, 3, 1], prompt=[2, 2], presence_penalty=0.5, frequency_penalty=0.25)
    got = process_logits(torch.zeros(1, 5), [seq])
    assert got.tolist() == [[0.0, -(0.5 + 2 * 0.25), 0.0, -(0.5 + 0.25), 0.0]]
    neg = _seq(generated=[4], presence_penalty=-1.0, frequency_penalty=-2.0)       # negative: encourage
    assert process_logits(torch.zeros(1, 5), [neg]).tolist() == [[0.0, 0.0, 0.0, 0.0, 3.0]]


def test_bias_and_penalties_apply_per_row():
    logits = torch.tensor([[0.0, 1.0], [0.0, 1.0], [0.0, 1.0]])
    seqs = [_seq(temperature=0), _seq(generated=[1], temperature=0, frequency_penalty=2.0),
            _seq(temperature=0, logit_bias={"0": 0.5})]
    assert process_logits(logits, seqs).tolist() == [[0.0, 1.0], [0.0, -1.0], [0.5, 1.0]]
    assert sample(logits, seqs)[0] == [1, 0, 1]


def test_logprobs_are_log_softmax_of_processed_logits_before_temperature():
    logits = torch.log(torch.tensor([[1.0, 2.0, 5.0]]))           # probabilities 1/8, 2/8, 5/8
    (tok,), (lp,) = sample(logits, [_seq(temperature=0, logprobs=2)])
    assert tok == 2 and lp.token_id == 2
    assert lp.logprob == pytest.approx(math.log(5 / 8), abs=1e-6)
    assert [t for t, _ in lp.top] == [2, 1]
    assert [v for _, v in lp.top] == pytest.approx([math.log(5 / 8), math.log(2 / 8)], abs=1e-6)
    # with a bias of +ln 5 on token 0: weights 5, 2, 5 -> 5/12, 2/12, 5/12 whatever the temperature
    biased = _seq(temperature=0.3, seed=0, logprobs=3, logit_bias={"0": math.log(5)})
    (tok,), (lp,) = sample(logits, [biased])
    expected = {0: math.log(5 / 12), 1: math.log(2 / 12), 2: math.log(5 / 12)}
    assert lp.logprob == pytest.approx(expected[tok], abs=1e-6)
    assert dict(lp.top) == pytest.approx(expected, abs=1e-6)
    assert lp.top[-1][0] == 1


def test_top_logprobs_are_best_first_and_per_sequence():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0]] * 3)
    seqs = [_seq(temperature=0, logprobs=4), _seq(temperature=0), _seq(temperature=0, logprobs=0)]
    tokens, lps = sample(logits, seqs)
    assert tokens == [1, 1, 1]
    assert [t for t, _ in lps[0].top] == [1, 3, 2, 0]
    values = [v for _, v in lps[0].top]
    assert values == sorted(values, reverse=True)
    assert lps[0].logprob == values[0], "greedy's choice is the top-1"
    assert lps[1] is None
    assert lps[2].top == [] and lps[2].logprob == pytest.approx(values[0])
    ref = torch.log_softmax(logits[0], -1)
    assert values == pytest.approx(ref[[1, 3, 2, 0]].tolist(), abs=1e-6)


def test_no_log_softmax_when_no_sequence_asks(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("log_softmax computed without a request for logprobs")
    monkeypatch.setattr(torch, "log_softmax", boom)
    logits = torch.randn(3, 10)
    seqs = [_seq(temperature=0), _seq(temperature=0.7, seed=1), _seq(temperature=0, presence_penalty=1.0)]
    assert token_logprobs(logits, seqs, [0, 0, 0]) == [None, None, None]
    assert sample(logits, seqs)[1] == [None, None, None]
    assert process_logits(logits, seqs[:2]) is logits, "no copy when nothing changes the logits"


@pytest.mark.parametrize("params,param", [
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"),
    ({"logit_bias": {"-3": 1}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
])
def test_sampling_params_refuse_out_of_range(params, param):
    with pytest.raises(ValidationError) as exc:
        SamplingParams(**params)
    assert exc.value.param == param


# ---------------------------------------------------------------- the real server


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="module")
def eos_ids(smollm2_dir):
    from embedserve.models.llama import LlamaConfig
    return LlamaConfig.from_dir(smollm2_dir).eos_token_ids


def _post(server, path, body):
    return httpx.post(server + path, json={"model": GEN, **body}, timeout=120)


def _ok(r) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def _sse(server, path, body) -> list[dict]:
    with httpx.stream("POST", server + path, json={"model": GEN, "stream": True, **body}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


SHORT_ANSWER = [{"role": "user", "content": "Reply with one word: yes or no. Is water wet?"}]


def test_negative_bias_on_eos_runs_to_max_tokens(server, eos_ids):
    body = {"messages": SHORT_ANSWER, "temperature": 0, "max_tokens": 20}
    plain = _ok(_post(server, "/v1/chat/completions", body))
    assert plain["choices"][0]["finish_reason"] == "stop" and plain["usage"]["completion_tokens"] < 20
    biased = _ok(_post(server, "/v1/chat/completions", {**body, "logit_bias": {str(t): -100 for t in eos_ids}}))
    assert biased["choices"][0]["finish_reason"] == "length"
    assert biased["usage"]["completion_tokens"] == 20
    short = plain["choices"][0]["message"]["content"]
    assert biased["choices"][0]["message"]["content"].startswith(short)


def test_positive_bias_forces_one_token(server, tok):
    paris = tok(" Paris").input_ids
    assert len(paris) == 1
    r = _ok(_post(server, "/v1/completions", {"prompt": "My favourite fruit is", "temperature": 0, "max_tokens": 6,
                                              "logit_bias": {str(paris[0]): 100}, "logprobs": 0}))
    ch = r["choices"][0]
    assert ch["text"] == " Paris" * 6
    assert ch["logprobs"]["tokens"] == [" Paris"] * 6
    # logprobs are taken after the bias: the forced token is (almost) certain
    assert all(lp > -1e-3 for lp in ch["logprobs"]["token_logprobs"])


def test_penalties_break_repetition(server, tok):
    body = {"prompt": "1, 1, 1, 1, 1, 1, 1, 1,", "temperature": 0, "max_tokens": 16, "ignore_eos": True,
            "logprobs": 0}
    plain = _ok(_post(server, "/v1/completions", body))["choices"][0]["logprobs"]["tokens"]
    pen = _ok(_post(server, "/v1/completions", {**body, "presence_penalty": 2, "frequency_penalty": 2}))
    pen = pen["choices"][0]["logprobs"]["tokens"]
    assert len(set(plain)) <= 3
    assert len(set(pen)) > len(set(plain)) + 3


def test_completion_logprobs_match_the_hf_reference(server, smollm2_dir, tok):
    from transformers import AutoModelForCausalLM
    prompt = "The capital of France is"
    r = _ok(_post(server, "/v1/completions", {"prompt": prompt, "temperature": 0, "max_tokens": 8,
                                              "ignore_eos": True, "logprobs": 3}))
    ch, lp = r["choices"][0], r["choices"][0]["logprobs"]
    n = r["usage"]["completion_tokens"]
    assert n == 8 and len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    assert "".join(lp["tokens"]) == ch["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert len(top) == 3 and top[token] == value == max(top.values()), "greedy: the chosen token is the top-1"
    # the same numbers from HF's fp32 forward over prompt + its own greedy completion
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    ids = tok(prompt).input_ids
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
        assert tok.batch_decode([[i] for i in out]) == lp["tokens"]
        ref = torch.log_softmax(hf(torch.tensor([ids + out])).logits[0, len(ids) - 1:-1].float(), -1)
    for i, (t, top) in enumerate(zip(out, lp["top_logprobs"])):
        assert lp["token_logprobs"][i] == pytest.approx(float(ref[i, t]), abs=LOGPROB_TOL)
        assert sorted(top.values(), reverse=True) == pytest.approx(ref[i].topk(3).values.tolist(), abs=LOGPROB_TOL)


def test_chat_logprobs_streamed_equal_non_streamed(server, tok, eos_ids):
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0,
            "max_tokens": 30, "logprobs": True, "top_logprobs": 2}
    whole = _ok(_post(server, "/v1/chat/completions", body))
    content = whole["choices"][0]["logprobs"]["content"]
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert len(content) == whole["usage"]["completion_tokens"] > 2
    for e in content:
        assert e["bytes"] == list(e["token"].encode())
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][1]["logprob"]
        assert (e["token"], e["logprob"]) == (e["top_logprobs"][0]["token"], e["top_logprobs"][0]["logprob"])
    # the EOS token that ended the answer is reported too (it counts in usage), as vLLM does
    assert content[-1]["token"] in {tok.decode([t]) for t in eos_ids}
    assert "".join(e["token"] for e in content[:-1]) == whole["choices"][0]["message"]["content"]
    chunks = _sse(server, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["logprobs"] is None                       # the role chunk
    streamed = [e for c in chunks for e in ((c["choices"][0]["logprobs"] or {}).get("content") or [])]
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=1e-5)
    for c in chunks[1:]:            # each chunk carries its own tokens' logprobs
        if c["choices"][0]["delta"].get("content"):
            assert c["choices"][0]["logprobs"]["content"]


def test_completion_logprobs_stream_offsets_continue(server):
    body = {"prompt": "Once upon a time", "temperature": 0, "max_tokens": 8, "ignore_eos": True, "logprobs": 1}
    whole = _ok(_post(server, "/v1/completions", body))["choices"][0]["logprobs"]
    chunks = _sse(server, "/v1/completions", body)
    parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    assert len(parts) > 1
    for key in ("tokens", "text_offset"):
        assert [x for p in parts for x in p[key]] == whole[key]


def test_no_logprobs_unless_asked(server):
    r = _ok(_post(server, "/v1/chat/completions", {"messages": SHORT_ANSWER, "max_tokens": 3}))
    assert r["choices"][0]["logprobs"] is None
    r = _ok(_post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 3}))
    assert r["choices"][0]["logprobs"] is None


CHAT = "/v1/chat/completions"
COMP = "/v1/completions"


@pytest.mark.parametrize("path,field,value", [
    (CHAT, "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    (CHAT, "tool_choice", "auto"),
    (CHAT, "functions", [{"name": "f", "parameters": {}}]),
    (CHAT, "function_call", "auto"),
    (CHAT, "response_format", {"type": "json_object"}),
    (CHAT, "modalities", ["text", "audio"]),
    (CHAT, "audio", {"voice": "alloy", "format": "wav"}),
    (CHAT, "prediction", {"type": "content", "content": "x"}),
    (CHAT, "reasoning_effort", "low"),
    (CHAT, "verbosity", "low"),
    (CHAT, "web_search_options", {}),
    (CHAT, "repetition_penalty", 1.2),
    (COMP, "best_of", 2),
    (COMP, "suffix", "the end"),
    (COMP, "echo", True),
    (COMP, "repetition_penalty", 1.1),
])
def test_unimplemented_fields_are_refused_by_name(server, path, field, value):
    body = {"messages": SHORT_ANSWER} if path == CHAT else {"prompt": "Hello"}
    r = _post(server, path, {**body, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert e["param"] == field and e["type"] == "invalid_request_error"
    assert f"`{field}` is not supported" in e["message"] and "remove it" in e["message"]


@pytest.mark.parametrize("path,body,param,needle", [
    (CHAT, {"temprature": 0.5}, "temprature", "`temprature` is not a field"),
    (COMP, {"min_p": 0.1, "foo": 1}, "min_p", "`min_p`, `foo` are not fields"),
    (COMP, {"tools": []}, "tools", "`tools` is not a field"),                  # a chat field
    (CHAT, {"logit_bias": {"49152": 5}}, "logit_bias", "49152"),
    (CHAT, {"logit_bias": {"7": 150}}, "logit_bias", "[-100, 100]"),
    (COMP, {"logit_bias": {"abc": 1}}, "logit_bias", "'abc'"),
    (COMP, {"presence_penalty": 2.5}, "presence_penalty", "presence_penalty"),
    (CHAT, {"frequency_penalty": -3}, "frequency_penalty", "frequency_penalty"),
    (COMP, {"logprobs": 21}, "logprobs", "20"),
    (CHAT, {"top_logprobs": 2}, "top_logprobs", "logprobs: true"),
    (CHAT, {"logprobs": True, "top_logprobs": 25}, "top_logprobs", "20"),
    (CHAT, {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats", "continuous_usage_stats"),
    (COMP, {"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "boolean"),
    (CHAT, {"stream_options": {"include_usage": True}}, "stream_options", "`stream: true`"),
])
def test_bad_values_and_unknown_fields_are_400(server, path, body, param, needle):
    base = {"messages": SHORT_ANSWER} if path == CHAT else {"prompt": "Hello"}
    r = _post(server, path, {**base, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    e = r.json()["error"]
    assert e["param"] == param and needle in e["message"], e


def test_harmless_fields_are_accepted_and_change_nothing(server):
    chat = {"messages": SHORT_ANSWER, "temperature": 0, "max_tokens": 6}
    harmless = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
                "parallel_tool_calls": True, "stream_options": None, "seed": 3, "n": 1,
                "response_format": {"type": "text"}, "tool_choice": "none", "tools": [],
                "prompt_cache_key": "k", "safety_identifier": "s", "repetition_penalty": 1.0}
    ref = _ok(_post(server, CHAT, chat))["choices"][0]["message"]["content"]
    assert _ok(_post(server, CHAT, {**chat, **harmless}))["choices"][0]["message"]["content"] == ref
    comp = {"prompt": "Once upon a time", "temperature": 0, "max_tokens": 6}
    ref = _ok(_post(server, COMP, comp))["choices"][0]["text"]
    extra = {"user": "u1", "seed": 3, "n": 1, "echo": False, "best_of": 1, "suffix": "", "logprobs": None}
    assert _ok(_post(server, COMP, {**comp, **extra}))["choices"][0]["text"] == ref


def test_openai_sdk_reads_logprobs_and_sends_logit_bias(server, eos_ids):
    sdk = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    r = sdk.chat.completions.create(model=GEN, messages=SHORT_ANSWER, temperature=0, max_tokens=5,
                                    logprobs=True, top_logprobs=3, logit_bias={str(t): -100 for t in eos_ids})
    assert r.choices[0].finish_reason == "length" and len(r.choices[0].logprobs.content) == 5
    first = r.choices[0].logprobs.content[0]
    assert first.token == first.top_logprobs[0].token and len(first.top_logprobs) == 3
    c = sdk.completions.create(model=GEN, prompt="The capital of France is", max_tokens=3, temperature=0,
                               logprobs=2, frequency_penalty=0.5)
    assert len(c.choices[0].logprobs.tokens) == 3 and len(c.choices[0].logprobs.top_logprobs[0]) == 2
    with pytest.raises(openai.BadRequestError) as exc:
        sdk.chat.completions.create(model=GEN, messages=SHORT_ANSWER, response_format={"type": "json_object"})
    assert "response_format" in str(exc.value)

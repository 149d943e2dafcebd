"""The agent-facing API through the official `openai` client: logprobs (with and without a
draft), ``n`` > 1 with a seed, /tokenize and /detokenize, /metrics, and 400s for the fields lucepy
does not implement. One server on the tiny agreeing target, one with its DFlash draft."""

from __future__ import annotations

import json
import re

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from lucepy.decode.ar import generate
from lucepy.decode.grammar import grammars_for, json_grammar, regex_grammar
from lucepy.engine import Engine
from lucepy.runtime.config import RuntimeConfig
from lucepy.server.run import Server
from lucepy.testing.tiny_draft import write_agreeing_pair

CTX = 256
TOP = 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return write_agreeing_pair(tmp_path_factory.mktemp("api"))


@pytest.fixture(scope="module", params=["plain", "draft"])
def served(request, pair):
    target, draft = pair
    cfg = RuntimeConfig(
        threads=1, max_ctx=CTX, draft=str(draft) if request.param == "draft" else None
    )
    srv = Server(Engine(target, cfg), name="tiny", port=0, log_level="warning").start()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
    yield srv, client, request.param
    client.close()
    srv.stop()


@pytest.fixture(scope="module")
def reference(pair):
    """An Engine over the same file: its greedy tokens, and the log-softmax (float64) of the
    logits it computes at each position of an answer."""
    engine = Engine(pair[0], RuntimeConfig(threads=1, max_ctx=CTX))

    class Reference:
        encode = engine.tokenizer.encode
        token_bytes = engine.tokenizer.token_bytes

        @staticmethod
        def greedy(prompt: list[int], n: int) -> list[int]:
            return generate(engine, prompt, n).tokens

        @staticmethod
        def logsoftmax(prompt: list[int], tokens: list[int]) -> np.ndarray:
            engine.reset()
            logits = engine.prefill(prompt + tokens[:-1], all_logits=True)[len(prompt) - 1 :]
            z = logits.astype(np.float64)
            m = z.max(axis=1, keepdims=True)
            return z - (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))

    yield Reference
    engine.close()


def chatml(content: str) -> str:
    return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


def check_against(ref, prompt: list[int], n: int, entries: list[tuple[bytes, float, list]]):
    """Each (token bytes, logprob, top logprobs) is the greedy token's, under its reference row:
    the log-probability within 1e-4, and the TOP best in order."""
    tokens = ref.greedy(prompt, n)
    lp = ref.logsoftmax(prompt, tokens)
    assert [e[0] for e in entries] == [ref.token_bytes(t) for t in tokens]
    for i, (token, (_, logprob, tops)) in enumerate(zip(tokens, entries, strict=True)):
        assert abs(logprob - lp[i, token]) < 1e-4
        best = np.argsort(-lp[i], kind="stable")[:TOP]
        np.testing.assert_allclose(tops, lp[i, best], atol=1e-4)


def test_chat_logprobs_are_the_log_softmax_of_the_logits(served, reference):
    _, client, _ = served
    messages = [{"role": "user", "content": "hello there"}]
    prompt = reference.encode(chatml("hello there"))
    kw = dict(model="tiny", messages=messages, temperature=0, max_tokens=12, logprobs=True)
    reply = client.chat.completions.create(**kw, top_logprobs=TOP)
    content = reply.choices[0].logprobs.content
    entries = [(bytes(c.bytes), c.logprob, [t.logprob for t in c.top_logprobs]) for c in content]
    check_against(reference, prompt, 12, entries)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-9 for c in content)  # greedy
    # streamed: the same entries, spread over the chunks
    streamed = []
    for chunk in client.chat.completions.create(**kw, top_logprobs=TOP, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed.extend(chunk.choices[0].logprobs.content)
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    # without logprobs, none come back
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_have_openais_legacy_shape(served, reference):
    _, client, _ = served
    prompt = reference.encode("once upon a time")
    reply = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=10, temperature=0, logprobs=TOP
    )
    lp = reply.choices[0].logprobs
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    tokens = reference.greedy(prompt, 10)
    rows = reference.logsoftmax(prompt, tokens)
    text = [reference.token_bytes(t).decode("utf-8", errors="replace") for t in tokens]
    assert lp.tokens == text
    for i, token in enumerate(tokens):
        assert abs(lp.token_logprobs[i] - rows[i, token]) < 1e-4
        want: dict[str, float] = {}  # keyed by text: the likelier of two that read the same
        for j in np.argsort(-rows[i], kind="stable")[:TOP]:
            piece = reference.token_bytes(int(j)).decode("utf-8", errors="replace")
            want.setdefault(piece, rows[i, j])
        assert lp.top_logprobs[i].keys() == want.keys()
        assert all(abs(lp.top_logprobs[i][k] - v) < 1e-4 for k, v in want.items())


def test_n_choices_with_a_seed_are_reproducible(served):
    _, client, _ = served
    kw = dict(model="tiny", messages=[{"role": "user", "content": "go"}], max_tokens=16)
    first = client.chat.completions.create(**kw, n=3, seed=11, temperature=1.0)
    again = client.chat.completions.create(**kw, n=3, seed=11, temperature=1.0)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]
    assert len(set(texts)) > 1  # seed, seed + 1, seed + 2: different draws
    streamed = {i: "" for i in range(3)}
    finished = set()
    for chunk in client.chat.completions.create(**kw, n=3, seed=11, temperature=1.0, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert [streamed[i] for i in range(3)] == texts and finished == {0, 1, 2}
    # choice 0 is the single answer with the same seed
    one = client.chat.completions.create(**kw, seed=11, temperature=1.0)
    assert one.choices[0].message.content == texts[0]
    # usage counts the prompt once and every choice's tokens
    assert first.usage.prompt_tokens == one.usage.prompt_tokens
    assert first.usage.completion_tokens > one.usage.completion_tokens


def test_tokenize_and_detokenize_round_trip(served):
    srv, _, _ = served
    r = httpx.post(srv.url + "/tokenize", json={"content": "hello world"})
    tokens = r.json()["tokens"]
    assert tokens and all(isinstance(t, int) for t in tokens)
    r = httpx.post(srv.url + "/detokenize", json={"tokens": tokens})
    assert r.json() == {"content": "hello world"}
    r = httpx.post(srv.url + "/detokenize", json={"tokens": [10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"


def test_metrics_parse_as_prometheus_text(served):
    srv, client, kind = served
    client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "count"}], max_tokens=5
    )
    r = httpx.get(srv.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in families.values() for s in f.samples}  # fmt: skip
    assert samples[("lucepy_requests_total", (("outcome", "completed"),))] >= 1
    assert samples[("lucepy_completion_tokens_total", ())] >= 5
    assert samples[("lucepy_time_to_first_token_seconds_count", ())] >= 1
    assert samples[("lucepy_ready", ())] == 1
    assert families["lucepy_requests_waiting"].type == "gauge"
    tau = samples[("lucepy_draft_tau", ())]
    assert (tau >= 1.0) if kind == "draft" else tau == 0


@pytest.mark.parametrize(
    "body",
    [
        {"tool_choice": "none"},
        {"response_format": {"type": "text"}},
        {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}},
        {"user": "someone", "metadata": {"a": "b"}, "store": False},
    ],
)
def test_fields_that_ask_for_nothing_are_accepted(served, body):
    srv, _, _ = served
    request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}
    assert httpx.post(srv.url + "/v1/chat/completions", json=request).status_code == 200


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
    ],
)
def test_any_model_name_gets_the_served_model(served, path, body):
    """The request's ``model`` is not checked (as llama-server does: clients often send a name of
    their own); the answer names the model served, as ``/v1/models`` does."""
    srv, client, _ = served
    reply = httpx.post(srv.url + path, json={"model": "gpt-4o", "max_tokens": 2, **body})
    assert reply.status_code == 200
    assert reply.json()["model"] == "tiny" == client.models.list().data[0].id


SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no", "maybe"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["answer", "count", "tags"],
    "additionalProperties": False,
}


def valid(text: str) -> bool:
    """Whether ``text`` is JSON that SCHEMA accepts (checked by hand: no jsonschema here)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return (
        isinstance(obj, dict)
        and set(obj) == {"answer", "count", "tags"}
        and obj["answer"] in ("yes", "no", "maybe")
        and type(obj["count"]) is int
        and 0 <= obj["count"] <= 999
        and isinstance(obj["tags"], list)
        and len(obj["tags"]) <= 3
        and all(t in ("a", "b") for t in obj["tags"])
    )


def test_a_strict_json_schema_always_validates(served):
    """100 sampled answers (10 requests of n=10, temperature 1) all validate, and the text
    before the constraint would not have (the tiny model writes no JSON of itself)."""
    _, client, _ = served
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA, "strict": True}}
    kw = dict(model="tiny", messages=[{"role": "user", "content": "json"}], max_tokens=64)
    texts = []
    for seed in range(10):
        reply = client.chat.completions.create(
            **kw, n=10, seed=100 * seed, temperature=1.0, response_format=fmt
        )
        assert all(c.finish_reason == "stop" for c in reply.choices)
        texts += [c.message.content for c in reply.choices]
    assert len(texts) == 100 and all(valid(t) for t in texts), [t for t in texts if not valid(t)]
    assert len(set(texts)) > 10  # sampled, not one forced answer
    free = client.chat.completions.create(**kw, n=10, seed=1, temperature=1.0)
    assert not any(valid(c.message.content) for c in free.choices)
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            **kw, seed=5, temperature=1.0, response_format=fmt, stream=True
        )
        if chunk.choices
    )
    assert valid(streamed)


def test_json_object_and_bad_schemas(served):
    srv, client, _ = served
    kw = dict(model="tiny", messages=[{"role": "user", "content": "obj"}], max_tokens=200)
    reply = client.chat.completions.create(
        **kw, temperature=0, response_format={"type": "json_object"}
    )
    text = reply.choices[0].message.content
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # a random model may write a long object: what it wrote opens one
        assert text.startswith("{")
    for fmt in (
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wizard"}}},
        {"type": "xml"},
    ):
        request = {"messages": [{"role": "user", "content": "hi"}], "response_format": fmt}
        r = httpx.post(srv.url + "/v1/chat/completions", json=request)
        assert r.status_code == 400, (fmt, r.text)
        assert r.json()["error"]["param"].startswith("response_format")


def test_speculation_stays_lossless_under_a_grammar(pair):
    """Greedy with the draft == greedy without, under a JSON schema (the agreeing draft's
    tokens are then never allowed) and under a grammar that forbids one character of the free
    answer (its tokens are kept until the grammar turns the answer): each verify row is masked
    after the tokens accepted before it."""
    target, draft = pair
    with Engine(target, RuntimeConfig(threads=1, max_ctx=CTX)) as engine:
        prompt = engine.tokenizer.encode(chatml("give me json"))
        free = engine.tokenizer.decode(generate(engine, prompt, 48).tokens)
    half = len(free) // 2  # ban a character the free answer first writes in its second half
    (banned, *_) = [c for c in free[half:] if c.isalnum() and c not in free[:half]]
    grammars = [json_grammar(SCHEMA), regex_grammar(f"[^{re.escape(banned)}]*")]
    for grammar in grammars:
        outs, accepted = [], 0
        for d in (None, draft):
            cfg = RuntimeConfig(threads=1, max_ctx=CTX, draft=str(d) if d else None)
            with Engine(target, cfg) as engine:
                g = grammars_for(engine.tokenizer, engine.params.n_vocab)
                gen = generate(engine, prompt, 48, constraint=g.constraint(grammar))
                outs.append(gen.tokens)
                accepted = gen.accept.accepted if d is not None else 0
                text = engine.tokenizer.decode(gen.tokens)
        assert outs[0] == outs[1]
        if grammar is grammars[0]:
            assert valid(text.removesuffix("<|im_end|>"))
        else:
            assert banned not in text and text != free and accepted > 0

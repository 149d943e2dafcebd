"""e2e tier: the OpenAI-compatible server through the official `openai` client.

One real uvicorn server per module (port 0, background thread) on the tiny model. Answers are
checked against the Engine itself, greedy, on a second Engine over the same file.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from lucepy.decode.ar import generate
from lucepy.engine import Engine
from lucepy.errors import (
    AuthError,
    ContextOverflow,
    GGMLError,
    LucepyError,
    ModelUnavailable,
    PromptError,
)
from lucepy.runtime.config import RuntimeConfig
from lucepy.server.errors import classify
from lucepy.server.run import Server
from lucepy.server.text import Detokenizer, StopFilter
from lucepy.testing.tiny_draft import write_agreeing_pair

KEY = "sk-lucepy-test"
CTX = 256


@pytest.fixture(scope="module")
def server(tiny_model):
    engine = Engine(tiny_model(), RuntimeConfig(threads=1, max_ctx=CTX))
    srv = Server(engine, name="tiny", port=0, api_key=KEY, log_level="warning").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def greedy(tiny_model):
    """greedy(prompt_tokens, n) -> (text, finish_reason, n_tokens), straight from an Engine."""
    engine = Engine(tiny_model(), RuntimeConfig(threads=1, max_ctx=CTX))

    def run(tokens, max_tokens):
        gen = generate(engine, tokens, max_tokens)
        text = engine.tokenizer.decode([t for t in gen.tokens if not engine.tokenizer.is_end(t)])
        return text, gen.finish_reason, len(gen.tokens)

    run.encode = engine.tokenizer.encode
    yield run
    engine.close()


def chatml(content: str) -> str:
    return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


def chat(client, content: str, **kw):
    messages = [{"role": "user", "content": content}]
    return client.chat.completions.create(model="tiny", messages=messages, temperature=0, **kw)


def wait_until(condition, what: str, limit: float = 20.0) -> None:
    """Wait for a condition the server reaches on its own (a bound, not a timing assumption)."""
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@contextlib.contextmanager
def gated(server, at_call: int = 1):
    """Hold the worker inside its ``at_call``-th decode step (``Engine._decode``: a plain or a
    greedy one) until the test releases it."""
    engine = server.worker.engine
    real, calls = engine._decode, [0]
    reached, release = threading.Event(), threading.Event()

    def decode(token, step):
        calls[0] += 1
        if calls[0] == at_call:
            reached.set()
            release.wait(30)
        return real(token, step)

    engine._decode = decode
    try:
        yield reached, release
    finally:
        release.set()
        del engine._decode


# --- endpoints ---


def test_health_models_and_status(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "model": "tiny"}
    assert [m.id for m in client.models.list().data] == ["tiny"]
    status = httpx.get(server.url + "/lucepy/status", headers={"Authorization": f"Bearer {KEY}"})
    body = status.json()
    assert body["n_ctx"] == CTX and body["state"] == "ready"
    [shard] = body["placement"]
    assert shard["device"] == "cpu" and shard["layers"] == [0, 4] and shard["weight_bytes"] > 0


def test_chat_is_the_engines_greedy_answer(client, greedy):
    reply = chat(client, "Hello", max_tokens=12)
    tokens = greedy.encode(chatml("Hello"))
    text, finish, n = greedy(tokens, 12)
    assert reply.choices[0].message.content == text
    assert reply.choices[0].finish_reason == finish
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(tokens), n)
    extras = reply.model_extra["lucepy"]
    assert extras["accept"] is None and extras["cache"] is None
    assert extras["timings"]["decode_tok_s"] > 0


def test_streaming_chat_equals_the_plain_answer(client):
    plain = chat(client, "Once upon a time", max_tokens=20).choices[0].message.content
    chunks = list(
        chat(
            client,
            "Once upon a time",
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain
    final, usage = chunks[-2], chunks[-1]
    assert final.choices[0].finish_reason == "length"
    assert final.model_extra["lucepy"]["timings"]["prefill_ms"] > 0
    assert not usage.choices and usage.usage.completion_tokens == 20


def test_completions_from_text_and_from_token_ids(client, greedy):
    tokens = greedy.encode("The small model")
    text, finish, _ = greedy(tokens, 10)
    by_text = client.completions.create(model="tiny", prompt="The small model", max_tokens=10,
                                        temperature=0)  # fmt: skip
    by_ids = client.completions.create(model="tiny", prompt=tokens, max_tokens=10, temperature=0)
    streamed = client.completions.create(
        model="tiny", prompt=tokens, max_tokens=10, temperature=0, stream=True
    )
    assert by_text.choices[0].text == by_ids.choices[0].text == text
    assert by_text.choices[0].finish_reason == finish
    assert "".join(c.choices[0].text for c in streamed) == text


def test_stop_sequences_cut_the_text_in_both_modes(client):
    full = chat(client, "In the morning", max_tokens=40).choices[0].message.content
    # a stop made of plain letters that first occurs after a few characters
    at = next(m.start() for m in re.finditer(r"[a-z]{3}", full) if m.start() >= 3)
    stop = full[at : at + 3]
    expected = full[: full.index(stop)]
    reply = chat(client, "In the morning", max_tokens=40, stop=["no such stop", stop])
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason == "stop"
    chunks = list(chat(client, "In the morning", max_tokens=40, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_filter_holds_back_what_may_begin_a_stop():
    f = StopFilter(["<|end|>"])
    assert [f.feed(x) for x in ("ab", "c<", "|e", "x")] == ["ab", "c", "", "<|ex"]
    assert [f.feed(x) for x in ("y<|", "en", "d|>z")] == ["y", "", ""]
    assert f.stopped and f.flush() == ""
    g = StopFilter(["abc"])
    assert g.feed("xab") == "x" and g.flush() == "ab"


def test_detokenizer_waits_for_whole_characters():
    pieces = {1: b"\xc3", 2: b"\xa9", 3: b"!"}

    def decode(tokens):
        return b"".join(pieces[t] for t in tokens).decode("utf-8", errors="replace")

    d = Detokenizer(decode)
    assert [d.push(t) for t in (1, 2, 3)] == ["", "é", "!"]
    d.push(1)
    assert d.flush() == "\ufffd"


# --- errors ---


def test_prompt_longer_than_the_context_is_400(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=[5] * (CTX + 10), max_tokens=4)
    assert err.value.status_code == 400
    assert err.value.body["code"] == "context_length_exceeded"
    assert err.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, "word " * CTX, max_tokens=4)
    assert err.value.body["param"] == "messages"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 17}, "n"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ],
)
def test_bad_fields_are_400_with_the_param(server, body, param):
    request = {"messages": [{"role": "user", "content": "hi"}], **body}
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json=request,
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert set(error) == {"message", "type", "param", "code"}


def test_a_bad_api_key_is_401(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError) as err:
            chat(c, "hi", max_tokens=2)
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # health needs no key


def test_exception_types_map_to_statuses():
    assert classify(ContextOverflow("x"))[0] == 400
    assert classify(PromptError("x"))[0] == 400
    assert classify(AuthError("x"))[0] == 401
    assert classify(GGMLError("x"))[0] == 503
    assert classify(ModelUnavailable("x"))[0] == 503
    assert classify(LucepyError("x"))[0] == 500
    assert classify(RuntimeError("x"))[0] == 500


def test_a_failed_model_is_503_until_restarted(server, client):
    engine = server.worker.engine

    def broken(token, step):
        raise GGMLError("graph compute on cpu failed with status 1")

    engine._decode = broken
    try:
        with pytest.raises(openai.InternalServerError) as err:
            chat(client, "Hello", max_tokens=8)
        assert err.value.status_code == 503 and err.value.body["code"] == "model_failed"
        assert httpx.get(server.url + "/health").status_code == 503
        with pytest.raises(openai.InternalServerError) as err:
            chat(client, "Hello", max_tokens=8)
        assert err.value.body["code"] == "model_unavailable"
    finally:
        del engine._decode
        server.worker.failure = None  # only a test revives a failed model


# --- cancellation and concurrency ---


def test_a_disconnect_cancels_the_generation(server, greedy):
    tokens = greedy.encode("Once upon a time")
    assert greedy(tokens, 200)[1] == "length"  # left alone, it would make all 200 tokens
    before = server.status()["requests"]["cancelled"]
    body = {"prompt": tokens, "max_tokens": 200, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with gated(server, at_call=3) as (reached, release):
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            assert reached.wait(20)
        job = server.worker.current
        wait_until(job.cancel.is_set, "the server to notice the disconnect")
        release.set()
        wait_until(lambda: server.status()["requests"]["cancelled"] == before + 1, "the count")
    last = server.status()["last"]
    assert last["finish_reason"] == "cancelled"
    assert last["completion_tokens"] == 4  # three decode steps, one more token, then it stopped


def test_concurrent_clients_queue_and_get_their_own_answers(server, client):
    prompts = ["Once upon a time", "The small model", "In the morning", "Children played"]
    alone = [chat(client, p, max_tokens=16).choices[0].message.content for p in prompts]
    assert len(set(alone)) == 4  # different answers, so a mix-up would show
    with gated(server) as (reached, release), ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(chat, client, p, max_tokens=16) for p in prompts]
        assert reached.wait(20)
        wait_until(lambda: server.status()["queue"] == {"waiting": 3, "active": 1}, "the queue")
        release.set()
        together = [f.result().choices[0].message.content for f in futures]
    assert together == alone


def test_top_once_shows_the_placement(server):
    from typer.testing import CliRunner

    from lucepy.cli import app

    result = CliRunner().invoke(app, ["top", server.url, "--once", "--api-key", KEY])
    assert result.exit_code == 0, result.output
    assert "tiny" in result.output and "cpu" in result.output and "tokens/s" in result.output


# --- the command, as a user runs it ---


@contextlib.contextmanager
def lucepy_serve(cwd, *args: str, env: dict | None = None):
    """`lucepy serve ARGS --port 0` in a subprocess; yields its URL; Ctrl-C must stop it cleanly."""
    base = {**os.environ, "LUCEPY_CACHE_DIR": str(cwd / "cache"), "HOME": str(cwd)}
    base.pop("LUCEPY_MODELS", None)
    env = {**base, **(env or {})}
    cmd = [sys.executable, "-m", "lucepy", "serve", *args, "--port", "0", "--threads", "1"]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        yield _served_url(proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "Traceback" not in err


def test_serve_with_no_model_answers_with_smollm2(tmp_path):
    """The README's quick start: the default model, through the official client, greedy."""
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    with lucepy_serve(tmp_path) as url:
        health = httpx.get(url + "/health").json()
        assert health == {"status": "ok", "model": "smollm2-135m-instruct"}
        with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as c:
            reply = c.chat.completions.create(
                model="smollm2-135m-instruct", messages=messages, temperature=0, max_tokens=32
            )
    text = reply.choices[0].message.content
    assert reply.model == "smollm2-135m-instruct" and reply.choices[0].finish_reason == "stop"
    assert "Paris" in text and text.rstrip().endswith(".") and len(text.split()) >= 3, text
    # nothing downloaded; written: the step costs of the shipped draft, measured once
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["step-costs"]


def test_serve_lucepy_tiny_writes_the_builtin_on_first_use(tmp_path):
    # a fixed block: its random draft would never pay, and auto would leave it out
    with lucepy_serve(tmp_path, "lucepy-tiny", "--draft-block", "8") as url:
        assert httpx.get(url + "/health").json() == {"status": "ok", "model": "lucepy-tiny"}
        with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as c:
            reply = chat(c, "Hello", max_tokens=5)
        assert reply.model == "lucepy-tiny" and reply.usage.completion_tokens >= 1
        assert reply.model_extra["lucepy"]["accept"] is not None  # with its built-in draft
    assert (tmp_path / "cache" / "models" / "lucepy-tiny-qwen35-v1.gguf").is_file()


def test_a_draft_changes_no_greedy_text_and_reports_acceptance(tmp_path):
    # a target that favours token 300 and a draft that agrees: partial acceptances (speculative.py)
    target, draft = write_agreeing_pair(tmp_path)
    yaml = tmp_path / "models.yaml"
    yaml.write_text(f"models:\n  drafted:\n    file: {target}\n    draft: {draft}\n")
    # a fixed block: with auto lengths whether this tiny pair drafts depends on measured times
    runs = {
        "plain": (str(target),),
        "--draft": (str(target), "--draft", str(draft), "--draft-block", "8"),
        "models.yaml": ("drafted", "--draft-block", "8"),
    }
    answers = {}
    for how, args in runs.items():
        with lucepy_serve(tmp_path, *args, env={"LUCEPY_MODELS": str(yaml)}) as url:
            with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as c:
                reply = chat(c, "Hello", max_tokens=24)
            status = httpx.get(url + "/lucepy/status").json()["accept"]
        answers[how] = reply.choices[0].message.content, reply.model_extra["lucepy"]["accept"]
        assert (status["tau"] is None) == (how == "plain")
    text, accept = answers.pop("plain")
    assert accept is None and text
    for how, (spec_text, stats) in answers.items():
        assert spec_text == text, how
        assert stats["steps"] > 0 and sum(stats["histogram"]) == stats["steps"], (how, stats)
        assert stats["accepted"] > 0, (how, stats)  # some drafted tokens kept, some rolled back


def _served_url(proc: subprocess.Popen) -> str:
    seen = []
    while line := proc.stderr.readline():
        seen.append(line)
        m = re.search(r"serving \S+ on (http://\S+)", line)
        if m:
            return m.group(1)
    raise AssertionError("lucepy serve exited before serving:\n" + "".join(seen))


def test_served_prefix_cache_reports_ram_then_disk_hits(tiny_model, tmp_path):
    disk = ["--kv-cache-dir", str(tmp_path / "kv"), "--disk-prefix-cache", "full"]
    replies, statuses = [], []
    # the second server has no RAM slots: its hit can only come from the first one's disk files
    for slots, n_requests in (("2", 2), ("0", 1)):
        with lucepy_serve(tmp_path, str(tiny_model()), "--prefix-cache-slots", slots, *disk) as url:
            with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as c:
                replies += [chat(c, "Hello", max_tokens=6) for _ in range(n_requests)]
            statuses.append(httpx.get(url + "/lucepy/status").json()["cache"])
    n = replies[0].usage.prompt_tokens
    assert statuses == [
        {"hits": 1, "misses": 1, "restored_tokens": n},
        {"hits": 1, "misses": 0, "restored_tokens": n},
    ]
    caches = [r.model_extra["lucepy"]["cache"] for r in replies]
    hits = [(x["hit"], x["restored_tokens"], x["prefilled_tokens"]) for x in caches]
    assert hits == [("none", 0, n), ("ram", n, 0), ("disk", n, 0)]
    assert len({r.choices[0].message.content for r in replies}) == 1  # restored == fresh


def _served_workers() -> list[int]:
    """Pids of `lucepy worker` processes whose parent is a `lucepy serve`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            cmd = (stat.parent / "cmdline").read_bytes().split(b"\0")
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            parent = Path(f"/proc/{ppid}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if b"worker" in cmd and b"lucepy" in cmd and b"serve" in parent:
            found.append(int(stat.parent.name))
    return found


def test_a_dead_worker_is_brought_back_by_the_next_request(tiny_model, tmp_path):
    with lucepy_serve(tmp_path, str(tiny_model()), "--device", "cpu,cpu@worker") as url:
        with openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0) as c:
            first = chat(c, "Hello", max_tokens=8).choices[0].message.content
            workers = _served_workers()
            assert len(workers) == 1
            os.kill(workers[0], signal.SIGKILL)
            time.sleep(0.2)
            again = chat(c, "Hello", max_tokens=8).choices[0].message.content
            assert httpx.get(url + "/health").json()["status"] == "ok"
        respawned = _served_workers()
    assert again == first
    assert len(respawned) == 1 and respawned != workers


@pytest.mark.parametrize(
    "path, body, param",
    [
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "hi \\ud800"}]}',
            "messages",
        ),
        ("/v1/completions", '{"prompt": "x\\udfff y"}', "prompt"),
    ],
)
def test_text_that_cannot_be_encoded_is_400_and_the_server_stays_up(
    server, client, path, body, param
):
    """A lone surrogate (valid JSON, not UTF-8) names its field; the next request is served."""
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(server.url + path, content=body, headers=headers)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param and "lone surrogate" in error["message"]
    assert chat(client, "hello", max_tokens=2).choices[0].finish_reason in ("length", "stop")

"""e2e tier: `--parallel` in the server, through the official `openai` client. Requests decode
together (decode/batch.py), streamed, and each gets the text it gets alone."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from conftest import THREADS

from lucepy.catalog import smollm2_draft_file, smollm2_file
from lucepy.decode.ar import generate
from lucepy.engine import Engine
from lucepy.errors import ConfigError
from lucepy.runtime.config import RuntimeConfig
from lucepy.server import jobs as jobs_module
from lucepy.server.jobs import Delta, Done, Job, Outbox
from lucepy.server.run import Server

PROMPTS = Path(__file__).parents[1] / "tools" / "dflash_prompts.json"
CTX = 256


def config(parallel: int) -> RuntimeConfig:
    return RuntimeConfig(threads=THREADS, max_ctx=CTX, parallel=parallel, batch_invariant=True)


@pytest.fixture(scope="module")
def server():
    srv = Server(Engine(smollm2_file(), config(4)), name="smol", port=0, log_level="warning")
    yield srv.start()
    srv.stop()


def streamed(client, tokens: list[int], n: int) -> str:
    stream = client.completions.create(
        model="smol", prompt=tokens, max_tokens=n, temperature=0, stream=True
    )
    return "".join(chunk.choices[0].text for chunk in stream)


def test_eight_streams_on_four_sequences_each_get_their_own_answer(server):
    prompts = json.loads(PROMPTS.read_text())["heldout"][:8]
    lengths = [20 + 3 * i for i in range(8)]
    with Engine(smollm2_file(), config(1)) as engine:
        want = []
        for p, n in zip(prompts, lengths, strict=True):
            gen = generate(engine, p, n)
            want.append(
                engine.tokenizer.decode([t for t in gen.tokens if not engine.tokenizer.is_end(t)])
            )
    with (
        openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0) as client,
        ThreadPoolExecutor(8) as pool,
    ):
        futures = [
            pool.submit(streamed, client, p, n) for p, n in zip(prompts, lengths, strict=True)
        ]
        got = [f.result() for f in futures]
    assert got == want
    batch = server.status()["batch"]
    assert batch["parallel"] == 4 and batch["active"] == 0
    assert batch["decoded"] > 2 * batch["decode"]  # steps decoded several requests at once


def test_events_wait_for_the_next_launch_and_go_in_one_wake_up(monkeypatch):
    """A step's events reach the event loop together, once per flush (the engine's next
    launch), through one byte on a pipe the loop reads, not one wake-up each: each wake-up let
    the loop take the GIL between steps."""
    writes = []
    write = jobs_module._write_holding_gil
    monkeypatch.setattr(jobs_module, "_write_holding_gil", lambda *a: (writes.append(a), write(*a)))
    loop = asyncio.new_event_loop()
    try:
        outbox = Outbox()
        jobs = [Job([1], 4, loop=loop, outbox=outbox) for _ in range(3)]
        for i, job in enumerate(jobs):
            job.emit(Delta(f"t{i}"))
        jobs[0].emit(Done("length", 1, 1, {}, 0.0))
        assert writes == [] and all(job.events.empty() for job in jobs)
        outbox.flush()
        outbox.flush()  # nothing held: no wake-up
        assert len(writes) == 1
        loop.run_until_complete(asyncio.sleep(0.05))  # the loop reads the pipe
        got = [[job.events.get_nowait() for _ in range(job.events.qsize())] for job in jobs]
        assert [[e.text for e in g if isinstance(e, Delta)] for g in got] == [
            ["t0"],
            ["t1"],
            ["t2"],
        ]
        assert isinstance(got[0][1], Done)
        jobs[1].emit(Delta("again"))
        outbox.flush()
        loop.run_until_complete(asyncio.sleep(0.05))
        assert len(writes) == 2 and jobs[1].events.get_nowait().text == "again"
        alone = Job([1], 4, loop=loop)  # not running yet: its event goes at once
        alone.emit(Delta("x"))
        loop.run_until_complete(asyncio.sleep(0))
        assert len(writes) == 2 and alone.events.get_nowait().text == "x"
        outbox.close()
        loop.run_until_complete(asyncio.sleep(0))
    finally:
        loop.close()


def test_streamed_tokens_arrive_while_the_batch_decodes(server):
    """Held events go at each launch: a client sees its text as it is made, not at the end."""
    prompts = json.loads(PROMPTS.read_text())["heldout"][:2]
    with openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0) as client:

        def arrivals(prompt):
            t0, times = time.perf_counter(), []
            stream = client.completions.create(
                model="smol", prompt=prompt, max_tokens=40, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    times.append(time.perf_counter())
            return t0, times

        with ThreadPoolExecutor(2) as pool:
            for t0, times in pool.map(arrivals, prompts):
                assert len(times) > 20
                assert times[-1] - times[0] > (times[-1] - t0) / 4


def test_a_sliding_window_model_refuses_parallel():
    ring = Path(__file__).parent / "fixtures" / "hf" / "gemma4-f32.gguf"
    with pytest.raises(ConfigError, match="sliding-window"):
        Engine(ring, RuntimeConfig(threads=1, max_ctx=64, parallel=2))


def test_a_client_that_leaves_frees_its_sequence(server):
    prompt = json.loads(PROMPTS.read_text())["heldout"][0]
    before = server.status()["requests"]["cancelled"]
    with openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0) as client:
        stream = client.completions.create(
            model="smol", prompt=prompt, max_tokens=200, temperature=0, stream=True
        )
        next(iter(stream))
        stream.close()  # the client goes away after its first piece of text
        for _ in range(200):
            status = server.status()
            if status["requests"]["cancelled"] == before + 1:
                break
            time.sleep(0.05)
        assert status["requests"]["cancelled"] == before + 1
        assert status["batch"]["active"] == 0 and status["last"]["completion_tokens"] < 200
        assert streamed(client, prompt, 4)  # and the server goes on serving


def test_a_lone_request_speculates_until_another_arrives_then_both_batch():
    """--parallel with a draft: the one request of an idle server decodes with the draft; when
    a second arrives it goes on plainly beside it. Both texts equal greedy decoding alone."""
    prompts = json.loads(PROMPTS.read_text())["heldout"][:2]
    lengths = [120, 30]
    with Engine(smollm2_file(), config(1)) as engine:
        want = [
            engine.tokenizer.decode(generate(engine, p, n, stop_at_end=False).tokens)
            for p, n in zip(prompts, lengths, strict=True)
        ]
    cfg = dataclasses.replace(config(2), draft=str(smollm2_draft_file()))
    srv = Server(Engine(smollm2_file(), cfg), name="smol", port=0, log_level="warning").start()
    try:
        with (
            openai.OpenAI(base_url=srv.url + "/v1", api_key="-", max_retries=0) as client,
            ThreadPoolExecutor(2) as pool,
        ):
            first = client.completions.create(
                model="smol", prompt=prompts[0], max_tokens=lengths[0], temperature=0,
                stream=True, extra_body={"ignore_eos": True},
            )  # fmt: skip
            pieces = [next(iter(first)).choices[0].text]  # it is speculating now
            second = pool.submit(
                lambda: client.completions.create(
                    model="smol", prompt=prompts[1], max_tokens=lengths[1], temperature=0,
                    extra_body={"ignore_eos": True},
                ).choices[0].text
            )  # fmt: skip
            pieces += [chunk.choices[0].text for chunk in first]
            got = ["".join(pieces), second.result()]
        status = srv.status()
    finally:
        srv.stop()
    assert got == want
    assert status["accept"]["steps"] > 0  # the first request speculated
    assert status["batch"]["decoded"] > status["batch"]["decode"]  # then two decoded together


def test_a_request_the_batch_cannot_take_runs_alone_in_its_turn(server):
    """Log-probabilities are computed on the one-sequence path: such a request waits for the
    batch to drain, runs alone, and gets the same text as a batched one."""
    prompt = json.loads(PROMPTS.read_text())["heldout"][2]
    with (
        openai.OpenAI(base_url=server.url + "/v1", api_key="-", max_retries=0) as client,
        ThreadPoolExecutor(3) as pool,
    ):
        batched = [pool.submit(streamed, client, prompt, 12) for _ in range(2)]
        alone = client.completions.create(
            model="smol", prompt=prompt, max_tokens=12, temperature=0, logprobs=2
        ).choices[0]
        texts = [f.result() for f in batched]
    assert alone.logprobs is not None and len(alone.logprobs.tokens) == 12
    assert texts == [alone.text, alone.text]

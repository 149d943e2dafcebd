"""The OpenAI-compatible app: /v1/chat/completions, /v1/completions, /v1/responses, /v1/models,
/health, /metrics (Prometheus), /tokenize, /detokenize and /lucepy/status. Handlers validate and
tokenize; the worker thread generates."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lucepy import __version__
from lucepy.decode.grammar import grammars_for
from lucepy.errors import AuthError, ContextOverflow, PromptError
from lucepy.server import errors
from lucepy.server.chat import chat_text
from lucepy.server.jobs import Delta, Failed, Job
from lucepy.server.responses import ResponsesRequest, Shaper
from lucepy.server.schemas import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    Reply,
    TokenizeRequest,
)
from lucepy.server.status import placement, prometheus
from lucepy.server.tools import tool_format
from lucepy.server.worker import Worker

POLL_S = 0.25  # how often a waiting non-streaming handler checks that its client is still there
_GONE = 499  # nginx's "client closed request": nobody reads it


class Served:
    """What the handlers share: the worker, the model's name and limits, the API key."""

    def __init__(self, worker: Worker, name: str, api_key: str | None):
        engine, tok = worker.engine, worker.engine.tokenizer
        self.worker, self.name, self.api_key = worker, name, api_key
        self.n_ctx, self.n_vocab = engine.n_ctx, engine.params.n_vocab
        self.tokenizer = tok
        self.tool_format = tool_format(tok.chat_template).bind(tok)  # how this model calls tools
        self.bos, self.eos = tok.token_text(tok.bos), tok.token_text(tok.eos)
        self.placement = placement(engine)
        self.created = int(time.time())
        self._pool_seen = engine.pool_report()

    async def encode(self, text: str, param: str) -> list[int]:
        if not text:
            raise _with_param(PromptError(f"{param} is empty; send some text"), param)
        if self.tokenizer.add_bos and self.bos and text.startswith(self.bos):
            text = text[len(self.bos) :]  # the tokenizer adds BOS itself
        try:
            return await asyncio.to_thread(self.tokenizer.encode, text)
        except PromptError as err:  # text the tokenizer cannot take
            raise _with_param(PromptError(f"{param}: {err}"), param) from None

    async def job(self, tokens: list[int], body, limit: int | None, param: str) -> Job:
        problem = body.problem()
        if problem:
            raise _with_param(PromptError(problem[1]), problem[0])
        grammar = await self.grammar(body)
        room = self.n_ctx - len(tokens)
        if room < 1:
            err = ContextOverflow(
                f"the prompt has {len(tokens)} tokens but the context holds {self.n_ctx}; "
                f"shorten it, or restart the server with a larger --max-ctx"
            )
            raise _with_param(err, param)
        max_tokens = min(limit or room, room)
        return Job(
            tokens,
            max_tokens,
            body.sampling(),
            tuple(body.stop),
            body.n,
            body.want_logprobs,
            grammar,
            self.tool_format.name if getattr(body, "calls_tools", False) else None,
            ignore_eos=body.ignore_eos,
        )

    async def grammar(self, body) -> str | None:
        """The request's grammar, checked against this vocabulary (a 400 if it cannot be used)."""
        try:
            grammar = body.grammar(self.tool_format)
            if grammar is not None:
                grammars = await asyncio.to_thread(grammars_for, self.tokenizer, self.n_vocab)
                await asyncio.to_thread(grammars.check, grammar)
        except PromptError as err:
            raise _with_param(err, "response_format") from None
        return grammar

    def status(self) -> dict:
        return {
            "model": self.name,
            "state": self.worker.state,
            "n_ctx": self.n_ctx,
            "placement": self.placement,
            "kv_pool": self._pool(),
            "batch": self._batch(),
            **self.worker.stats.snapshot(),
        }

    def _batch(self) -> dict | None:
        """--parallel: the sequences and the steps run (a decode step's tokens over its steps:
        how many requests decode together on average)."""
        batcher = self.worker.batcher
        if batcher is None:
            return None
        return {"parallel": batcher.engine.n_seq, "active": len(batcher.active), **batcher.steps}

    def _pool(self) -> dict | None:
        """KV Flash's pool report; read while the engine thread may be paging, so a read that
        races it keeps the last one."""
        with contextlib.suppress(RuntimeError):  # a set or dict changed size while read
            self._pool_seen = self.worker.engine.pool_report()
        return self._pool_seen


def _with_param(err: Exception, param: str) -> Exception:
    err.param = param
    return err


def served(request: Request) -> Served:
    return request.app.state.served


def authorized(request: Request) -> Served:
    s = served(request)
    if s.api_key:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip(), s.api_key):
            raise AuthError("missing or wrong API key; send `Authorization: Bearer KEY`")
    return s


PublicServed = Annotated[Served, Depends(served)]
Authorized = Annotated[Served, Depends(authorized)]
public = APIRouter()
private = APIRouter()


@public.get("/health")
async def health(s: PublicServed):
    state = s.worker.state
    body = {"status": "ok" if state == "ready" else state, "model": s.name}
    return JSONResponse(body, status_code=200 if state == "ready" else 503)


@private.get("/v1/models")
async def models(s: Authorized):
    card = {"id": s.name, "object": "model", "created": s.created, "owned_by": "lucepy"}
    return {"object": "list", "data": [card]}


@private.get("/lucepy/status")
async def status(s: Authorized):
    return s.status()


@private.get("/metrics")
async def metrics(s: Authorized):
    text = prometheus(s.worker.stats, s.worker.state == "ready")
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


@private.post("/tokenize")
async def tokenize(body: TokenizeRequest, s: Authorized):
    if not body.content:
        return {"tokens": []}
    try:
        tokens = await asyncio.to_thread(
            s.tokenizer.encode, body.content, body.parse_special, body.add_special
        )
    except PromptError as err:
        raise _with_param(PromptError(f"content: {err}"), "content") from None
    if not body.with_pieces:
        return {"tokens": tokens}
    pieces = [s.tokenizer.token_bytes(t).decode("utf-8", errors="replace") for t in tokens]
    return {"tokens": [{"id": t, "piece": p} for t, p in zip(tokens, pieces, strict=True)]}


@private.post("/detokenize")
async def detokenize(body: DetokenizeRequest, s: Authorized):
    bad = [t for t in body.tokens if not 0 <= t < s.n_vocab]
    if bad:
        msg = f"token ids must be in [0, {s.n_vocab}); got {bad[:5]}"
        raise _with_param(PromptError(msg), "tokens")
    return {"content": s.tokenizer.decode(body.tokens)}


@private.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request, s: Authorized):
    messages = [m.for_template() for m in body.messages]
    text = chat_text(s.tokenizer, messages, body.tool_dicts())
    tokens = await s.encode(text, "messages")
    job = await s.job(tokens, body, body.limit, "messages")
    return await _answer(request, s, job, Reply("chat", s.name), body)


@private.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, s: Authorized):
    tokens = await _prompt_tokens(s, body.prompt)
    job = await s.job(tokens, body, body.limit, "prompt")
    return await _answer(request, s, job, Reply("text", s.name), body)


async def _prompt_tokens(s: Served, prompt) -> list[int]:
    """A prompt as text or token ids; one prompt per request."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise _with_param(PromptError("send one prompt per request, not a batch"), "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        return await s.encode(prompt, "prompt")
    if not prompt:
        raise _with_param(PromptError("prompt is empty; send text or token ids"), "prompt")
    bad = [t for t in prompt if not 0 <= t < s.n_vocab]
    if bad:
        msg = f"token ids must be in [0, {s.n_vocab}); got {bad[:5]}"
        raise _with_param(PromptError(msg), "prompt")
    return list(prompt)


async def _answer(request: Request, s: Served, job: Job, reply: Reply, body) -> Response:
    s.worker.submit(job)
    if not body.stream:
        return await _collect(request, job, reply)
    first = await _next(request, job)  # waits for its turn and the prefill: errors get a status
    if first is None:
        return Response(status_code=_GONE)
    if isinstance(first, Failed):
        raise first.error
    events = _sse(job, reply, first, body.include_usage)
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


async def _next(request: Request, job: Job):
    """The job's next event, or None once the client has gone (the job is then cancelled)."""
    getter = asyncio.ensure_future(job.events.get())
    try:
        while True:
            done, _ = await asyncio.wait({getter}, timeout=POLL_S)
            if done:
                return getter.result()
            if await request.is_disconnected():
                job.cancel.set()
                return None
    finally:
        getter.cancel()  # a no-op once it holds its event


async def _gather(request: Request, job: Job):
    """Every choice's text, tool calls, log-probabilities and Done; None if the client left."""
    texts: dict[int, str] = {}
    calls: dict[int, list] = {}
    notes: dict[int, list] | None = None if job.logprobs is None else {}
    dones = []
    try:
        while True:
            event = await _next(request, job)
            if event is None:
                return None
            if isinstance(event, Failed):
                raise event.error
            if isinstance(event, Delta):
                texts[event.index] = texts.get(event.index, "") + event.text
                calls.setdefault(event.index, []).extend(event.tool_calls or [])
                if notes is not None:
                    notes.setdefault(event.index, []).extend(event.logprobs or [])
                continue
            dones.append(event)
            if len(dones) == job.n or event.finish_reason == "cancelled":
                if notes is not None:
                    notes = {d.index: notes.get(d.index, []) for d in dones}
                return texts, calls, notes, dones
    finally:
        job.cancel.set()  # no-op once done; stops the generation if this handler was cancelled


async def _collect(request: Request, job: Job, reply: Reply) -> Response:
    got = await _gather(request, job)
    if got is None:
        return Response(status_code=_GONE)
    texts, calls, notes, dones = got
    return JSONResponse(reply.full(texts, dones, notes, calls))


@private.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request, s: Authorized):
    chat = body.chat()
    fmt = (body.model_extra or {}).get("text", {}) or {}
    if isinstance(fmt, dict) and (fmt.get("format") or {}).get("type", "text") != "text":
        raise _with_param(PromptError("text.format other than text is not supported"), "text")
    messages = [m.for_template() for m in chat.messages]
    tokens = await s.encode(chat_text(s.tokenizer, messages, chat.tool_dicts()), "input")
    job = await s.job(tokens, chat, chat.limit, "input")
    shaper = Shaper(s.name)
    s.worker.submit(job)
    if not body.stream:
        got = await _gather(request, job)
        if got is None:
            return Response(status_code=_GONE)
        texts, calls, _, (done, *_) = got
        shaper.text, shaper.calls = texts.get(0, ""), calls.get(0, [])
        return JSONResponse(shaper.response("completed", done))
    first = await _next(request, job)
    if first is None:
        return Response(status_code=_GONE)
    if isinstance(first, Failed):
        raise first.error
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    events = _response_events(job, shaper, first)
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


async def _response_events(job: Job, shaper: Shaper, event):
    """The Responses API's streaming events for one generation."""
    try:
        yield shaper.event("response.created", response=shaper.response("in_progress"))
        yield shaper.event("response.in_progress", response=shaper.response("in_progress"))
        opened = False
        while True:
            if isinstance(event, Failed):
                status, body = errors.body_for(event.error)
                err = body["error"]
                yield shaper.event(
                    "error", code=err["code"], message=err["message"], param=err["param"]
                )
                return
            if isinstance(event, Delta):
                if event.text:
                    if not opened:
                        for line in shaper.opened():
                            yield line
                        opened = True
                    yield shaper.delta(event.text)
                for call in event.tool_calls or []:
                    for line in shaper.call(call, len(shaper.calls) + int(opened)):
                        yield line
            else:
                if opened:
                    for line in shaper.closed():
                        yield line
                final = shaper.response("completed", event)
                kind = (
                    "response.completed"
                    if final["status"] == "completed"
                    else "response.incomplete"
                )
                yield shaper.event(kind, response=final)
                return
            event = await job.events.get()
    finally:
        job.cancel.set()


def _data(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _sse(job: Job, reply: Reply, event, include_usage: bool):
    """Server-sent events; a client that leaves cancels the job (this generator is cancelled).
    Each choice opens with a chat role delta; choices come one after another."""
    opened: set[int] = set()
    dones = []
    try:
        while True:
            if isinstance(event, Failed):
                yield _data(errors.body_for(event.error)[1])
                return
            if reply.kind == "chat" and event.index not in opened:
                opened.add(event.index)
                yield _data(reply.chunk(index=event.index, first=True))
            if isinstance(event, Delta):
                yield _data(
                    reply.chunk(
                        event.text,
                        index=event.index,
                        logprobs=event.logprobs,
                        tool_calls=event.tool_calls,
                    )
                )
            else:
                yield _data(reply.chunk(index=event.index, done=event))
                dones.append(event)
                if len(dones) == job.n or event.finish_reason == "cancelled":
                    if include_usage:
                        yield _data(reply.usage_chunk(dones))
                    yield "data: [DONE]\n\n"
                    return
            event = await job.events.get()
    finally:
        job.cancel.set()


def create_app(worker: Worker, *, name: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="lucepy", version=__version__, docs_url=None, redoc_url=None)
    app.state.served = Served(worker, name, api_key)
    errors.install(app)
    app.include_router(public)
    app.include_router(private)
    return app

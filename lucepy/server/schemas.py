"""OpenAI request bodies (validated by pydantic) and the response objects we send back.

A field of OpenAI's API that lucepy does not implement is a 400 naming it when it asks for
something (``tools``, a ``response_format`` other than text, a penalty, ...); fields that change
nothing about the answer (``user``, ``metadata``, ``store``) are ignored. Responses carry lucepy's
own numbers under a ``lucepy`` key.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from lucepy.decode.sampling import SamplingParams

MAX_STOPS = 16
MAX_N = 16
# OpenAI fields lucepy does not implement, with the values that ask for nothing
_UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "echo": (None, False),
    "suffix": (None, ""),
    "best_of": (None, 1),
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept in model_extra, to refuse what asks

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # an extension; 0: no limit
    seed: int | None = None
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOPS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    ignore_eos: bool = False  # an extension (llama-server's): the end token does not stop it

    def problem(self) -> tuple[str, str] | None:
        """(field, message) for the first field that asks for something lucepy does not
        implement, or that contradicts another; None when the request can be served."""
        extra = self.model_extra or {}
        for name, harmless in _UNSUPPORTED.items():
            if name in extra and not any(extra[name] == h for h in harmless):
                return name, f"{name} is not supported by this server (lucepy); leave it out"
        return None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value):
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.seed)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # which call a tool message answers

    def for_template(self) -> dict:
        """As Hugging Face chat templates take it: a call's arguments as a mapping."""
        content = self.content or ""
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        return out


def _template_call(call: ToolCall) -> dict:
    try:
        args = json.loads(call.function.arguments)
    except ValueError:
        args = call.function.arguments
    fn = {"name": call.function.name, "arguments": args}
    return {"id": call.id, "type": "function", "function": fn}


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class ChoiceName(BaseModel):
    name: str


class NamedChoice(BaseModel):
    type: Literal["function"]
    function: ChoiceName


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool | None = None  # one call at most is forced; auto parses all

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def problem(self) -> tuple[str, str] | None:
        if self.top_logprobs and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        rf = self.response_format
        if rf is not None and rf.type == "json_schema" and rf.json_schema is None:
            return "response_format", "response_format json_schema needs a json_schema object"
        names = [t.function.name for t in self.tools or []]
        choice = self.tool_choice
        if isinstance(choice, NamedChoice) and choice.function.name not in names:
            return "tool_choice", f"tool_choice names {choice.function.name!r}, not one of tools"
        if choice == "required" and not names:
            return "tool_choice", "tool_choice required needs tools"
        if self.forced_tool and rf is not None and rf.type != "text":
            return "response_format", "a forced tool call and a response_format cannot combine"
        return super().problem()

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may hold tool calls (tools given, and tool_choice not none)."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced_tool(self) -> bool:
        return bool(self.tools) and (
            self.tool_choice == "required" or isinstance(self.tool_choice, NamedChoice)
        )

    def tool_dicts(self) -> list[dict] | None:
        """The tools as the chat template (and the grammar) take them; None when not offered."""
        if not self.calls_tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def grammar(self, tool_format=None) -> str | None:
        """The llguidance grammar ``response_format`` or a forced ``tool_choice`` asks for
        (None: free text); a forced call in ``tool_format`` (server/tools.py; Hermes if None)."""
        from lucepy.decode.grammar import json_grammar
        from lucepy.server.tools import HERMES

        if self.forced_tool:
            named = self.tool_choice if isinstance(self.tool_choice, NamedChoice) else None
            fmt = tool_format or HERMES
            return fmt.grammar(self.tool_dicts(), named.function.name if named else None)
        rf = self.response_format
        if rf is None or rf.type == "text":
            return None
        return json_grammar(rf.json_schema.schema_ if rf.type == "json_schema" else None)

    @property
    def want_logprobs(self) -> int | None:
        """Top tokens per token to report, or None for no log-probabilities."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=5)

    @property
    def limit(self) -> int:
        return self.max_tokens or 16  # OpenAI's default for /v1/completions

    @property
    def want_logprobs(self) -> int | None:
        return self.logprobs

    def grammar(self, tool_format=None) -> str | None:
        return None


def usage(dones: list) -> dict:
    """The prompt once, and every choice's tokens."""
    prompt = dones[0].prompt_tokens
    completion = sum(d.completion_tokens for d in dones)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip


def extras(done) -> dict:
    """lucepy's own numbers; ``accept`` is null without a draft, ``cache`` without a prefix
    cache's answer for this request."""
    timings, queue_ms = done.timings, done.queue_ms
    return {"timings": timings, "queue_ms": queue_ms, "accept": done.accept, "cache": done.cache}


def _by_text(top: list[dict]) -> dict[str, float]:
    """The legacy completions shape, keyed by token text: where two tokens read the same (byte
    pieces of a character), the likelier one stands."""
    out: dict[str, float] = {}
    for t in top:
        out.setdefault(t["token"], t["logprob"])
    return out


@dataclass
class Reply:
    """Shapes one request's answer: ``kind`` "chat" (chat.completion) or "text" (completions).
    Log-probabilities come as chat entries (``token``, ``logprob``, ``bytes``,
    ``top_logprobs``) and are reshaped for completions here, which needs each choice's text
    offset so far."""

    kind: Literal["chat", "text"]
    model: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))
    _offsets: dict[int, int] = field(default_factory=dict)

    def _head(self, obj: str) -> dict:
        prefix = "chatcmpl-" if self.kind == "chat" else "cmpl-"
        return {"id": prefix + self.id, "object": obj, "created": self.created, "model": self.model}

    def logprobs(self, entries: list[dict] | None, index: int = 0) -> dict | None:
        if entries is None:
            return None
        if self.kind == "chat":
            return {"content": entries, "refusal": None}
        offset, offsets = self._offsets.get(index, 0), []
        for e in entries:
            offsets.append(offset)
            offset += len(e["token"])
        self._offsets[index] = offset
        return {
            "tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [_by_text(e["top_logprobs"]) for e in entries],
            "text_offset": offsets,
        }  # fmt: skip

    def chunk(
        self,
        text: str = "",
        *,
        index: int = 0,
        first: bool = False,
        done=None,
        logprobs=None,
        tool_calls: list[dict] | None = None,
    ) -> dict:
        finish = done.finish_reason if done is not None else None
        lp = self.logprobs(logprobs, index)
        if self.kind == "chat":
            delta = {"role": "assistant", "content": text} if first else {}
            if text and not first:
                delta = {"content": text}
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": lp}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": lp}
            out = {**self._head("text_completion"), "choices": [choice]}
        if done is not None:
            out["lucepy"] = extras(done)
        return out

    def usage_chunk(self, dones: list) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage(dones)}

    def full(
        self,
        texts: dict[int, str],
        dones: list,
        logprobs: dict[int, list] | None,
        calls: dict[int, list] | None = None,
    ) -> dict:
        choices = []
        for done in dones:
            i = done.index
            lp = self.logprobs(logprobs[i], i) if logprobs is not None else None
            choice = {"index": i, "finish_reason": done.finish_reason, "logprobs": lp}
            if self.kind == "chat":
                message = {"role": "assistant", "content": texts.get(i, "")}
                if calls and calls.get(i):
                    message["content"] = message["content"].strip() or None
                    message["tool_calls"] = calls[i]
                choice["message"] = message
            else:
                choice["text"] = texts.get(i, "")
            choices.append(choice)
        head = self._head("chat.completion" if self.kind == "chat" else "text_completion")
        return {**head, "choices": choices, "usage": usage(dones), "lucepy": extras(dones[0])}


class TokenizeRequest(BaseModel):
    """llama-server's /tokenize body."""

    content: str
    add_special: bool = False  # a BOS where the model wants one
    parse_special: bool = True  # ``<|im_end|>`` in the text is that token, not its characters
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    tokens: list[int]

"""OpenAI request bodies (validated by pydantic) and the response objects we send back.

Fields lucepy does not implement are ignored, as OpenAI-compatible servers do; ``n`` must be 1.
Responses carry lucepy's own numbers under a ``lucepy`` key.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from lucepy.decode.sampling import SamplingParams

MAX_STOPS = 16


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # an extension; 0: no limit
    seed: int | None = None
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOPS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)

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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def for_template(self) -> dict:
        content = self.content or ""
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out = {"role": self.role, "content": content}
        if self.name:
            out["name"] = self.name
        return out


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]

    @property
    def limit(self) -> int:
        return self.max_tokens or 16  # OpenAI's default for /v1/completions


def usage(done) -> dict:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }


def extras(done) -> dict:
    """lucepy's own numbers; ``accept`` is null without a draft, ``cache`` without a prefix
    cache's answer for this request."""
    timings, queue_ms = done.timings, done.queue_ms
    return {"timings": timings, "queue_ms": queue_ms, "accept": done.accept, "cache": done.cache}


@dataclass
class Reply:
    """Shapes one request's answer: ``kind`` "chat" (chat.completion) or "text" (completions)."""

    kind: Literal["chat", "text"]
    model: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    def _head(self, obj: str) -> dict:
        prefix = "chatcmpl-" if self.kind == "chat" else "cmpl-"
        return {"id": prefix + self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, text: str = "", *, first: bool = False, done=None) -> dict:
        finish = done.finish_reason if done is not None else None
        if self.kind == "chat":
            delta = {"role": "assistant", "content": text} if first else {}
            if text and not first:
                delta = {"content": text}
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            out = {**self._head("text_completion"), "choices": [choice]}
        if done is not None:
            out["lucepy"] = extras(done)
        return out

    def usage_chunk(self, done) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage(done)}

    def full(self, text: str, done) -> dict:
        choice = {"index": 0, "finish_reason": done.finish_reason, "logprobs": None}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
            head = self._head("chat.completion")
        else:
            choice["text"] = text
            head = self._head("text_completion")
        return {**head, "choices": [choice], "usage": usage(done), "lucepy": extras(done)}

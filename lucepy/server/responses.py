"""OpenAI's Responses API (``/v1/responses``) at the level coding agents use it: text and
``function_call`` / ``function_call_output`` input items, ``instructions``, function tools and
``tool_choice``, ``max_output_tokens``, and streaming events. Each request becomes the chat
request it means (same template, tools, grammar and worker); there is no server-side state, so
``previous_response_id`` is refused.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from lucepy.errors import PromptError
from lucepy.server.schemas import ChatRequest


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool | None = None  # nothing is stored either way
    parallel_tool_calls: bool | None = None

    def chat(self) -> ChatRequest:
        """The chat request this one means; a PromptError (with ``param``) if it cannot be."""
        if self.previous_response_id:
            raise _param("previous_response_id", "lucepy keeps no responses; send the input whole")
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = (
            [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        )
        for i, item in enumerate(items):
            messages += _messages(item, f"input.{i}")
        if not messages:
            raise _param("input", "input is empty")
        body = {
            "messages": messages,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        if self.tools:
            body["tools"] = [_chat_tool(t, f"tools.{i}") for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            body["tool_choice"] = _chat_choice(self.tool_choice)
        try:
            return ChatRequest.model_validate(body)
        except ValueError as err:
            raise _param("input", f"the request does not translate to a chat: {err}") from None


def _param(name: str, message: str) -> PromptError:
    err = PromptError(message)
    err.param = name
    return err


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in (
                "input_text",
                "output_text",
                "text",
            ):
                raise _param(where, "only text content parts are supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise _param(where, "content must be text or a list of text parts")


def _messages(item: dict, where: str) -> list[dict]:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise _param(where + ".role", f"role {role!r} is not one of user, assistant, system")
        return [{"role": role, "content": _text(item.get("content", ""), where + ".content")}]
    if kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
        }
        return [{"role": "assistant", "content": None, "tool_calls": [call]}]
    if kind == "function_call_output":
        output = item.get("output")
        output = output if isinstance(output, str) else json.dumps(output)
        return [{"role": "tool", "tool_call_id": item.get("call_id"), "content": output}]
    raise _param(where + ".type", f"input items of type {kind!r} are not supported")


def _chat_tool(tool: dict, where: str) -> dict:
    if tool.get("type") != "function":
        raise _param(where + ".type", "only function tools are supported")
    fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _chat_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


class Shaper:
    """Builds the response object and its streaming events from the worker's events."""

    def __init__(self, model: str):
        self.id = "resp_" + uuid.uuid4().hex[:24]
        self.model, self.created = model, int(time.time())
        self.message_id = "msg_" + uuid.uuid4().hex[:24]
        self.text = ""
        self.calls: list[dict] = []
        self.seq = 0

    def response(self, status: str, done=None) -> dict:
        output = []
        if self.text or not self.calls:
            part = {"type": "output_text", "text": self.text, "annotations": []}
            output.append(
                {
                    "type": "message",
                    "id": self.message_id,
                    "role": "assistant",
                    "status": "completed" if done else "in_progress",
                    "content": [part],
                }
            )
        output += [self._call_item(c) for c in self.calls]
        out = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": status,
            "output": output,
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "error": None,
            "incomplete_details": None,
        }
        if done is not None:
            out["usage"] = {
                "input_tokens": done.prompt_tokens,
                "output_tokens": done.completion_tokens,
                "total_tokens": done.prompt_tokens + done.completion_tokens,
                "input_tokens_details": {
                    "cached_tokens": (done.cache or {}).get("restored_tokens", 0)
                },
                "output_tokens_details": {"reasoning_tokens": 0},
            }
            if done.finish_reason == "length":
                out["status"] = "incomplete"
                out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out

    @staticmethod
    def _call_item(call: dict) -> dict:
        fn = call["function"]
        return {
            "type": "function_call",
            "id": "fc_" + call["id"].removeprefix("call_"),
            "call_id": call["id"],
            "name": fn["name"],
            "arguments": fn["arguments"],
            "status": "completed",
        }

    def event(self, kind: str, **fields) -> str:
        self.seq += 1
        body = {"type": kind, "sequence_number": self.seq, **fields}
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    # streaming: the message item opens with its first text
    def opened(self) -> list[str]:
        item = {
            "type": "message",
            "id": self.message_id,
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            self.event("response.output_item.added", output_index=0, item=item),
            self.event(
                "response.content_part.added",
                item_id=self.message_id,
                output_index=0,
                content_index=0,
                part=part,
            ),
        ]

    def delta(self, text: str) -> str:
        self.text += text
        return self.event(
            "response.output_text.delta",
            item_id=self.message_id,
            output_index=0,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def closed(self) -> list[str]:
        part = {"type": "output_text", "text": self.text, "annotations": []}
        item = {
            "type": "message",
            "id": self.message_id,
            "role": "assistant",
            "status": "completed",
            "content": [part],
        }
        return [
            self.event(
                "response.output_text.done",
                item_id=self.message_id,
                output_index=0,
                content_index=0,
                text=self.text,
                logprobs=[],
            ),
            self.event(
                "response.content_part.done",
                item_id=self.message_id,
                output_index=0,
                content_index=0,
                part=part,
            ),
            self.event("response.output_item.done", output_index=0, item=item),
        ]

    def call(self, call: dict, index: int) -> list[str]:
        self.calls.append(call)
        item = self._call_item(call)
        return [
            self.event(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "arguments": ""},
            ),
            self.event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=index,
                delta=item["arguments"],
            ),
            self.event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=item["arguments"],
                name=item["name"],
            ),
            self.event("response.output_item.done", output_index=index, item=item),
        ]

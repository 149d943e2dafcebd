"""Tool calls in the Hermes/Qwen format: ``<tool_call>`` + ``{"name": ..., "arguments": {...}}``
+ ``</tool_call>``.

- Rendering: a chat template that knows ``tools`` (Qwen's do) gets them, and the conversation's
  tool calls and results, as Hugging Face passes them. For a template that does not (SmolLM2's,
  plain ChatML), lucepy writes the tools into the system message in this format itself, shows
  earlier calls as the assistant's text, and tool results as user turns inside
  ``<tool_response>`` tags.
- Forcing: ``tool_choice`` ``required`` or a named function becomes a grammar (one call, with
  arguments that validate against the function's parameters), so the call is decoded, not hoped
  for.
- Parsing: ``ToolCallParser`` cuts the calls out of the streamed text; what is outside them is
  content.
"""

from __future__ import annotations

import json
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def knows_tools(template: str | None) -> bool:
    """Whether a chat template renders ``tools`` itself."""
    return bool(template) and "tools" in template


def template_messages(messages: list[dict], tools: list[dict] | None, native: bool) -> list[dict]:
    """The messages to render. ``native``: the template takes ``tools`` and tool messages as they
    are; otherwise the tools go into the system message and calls and results become text."""
    if native or not tools and not _has_tool_turns(messages):
        return messages
    out = []
    for m in messages:
        if m["role"] == "tool":
            text = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            out.append({"role": "user", "content": text})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = [_call_text(c) for c in m["tool_calls"]]
            text = "\n".join(([m["content"]] if m.get("content") else []) + calls)
            out.append({"role": "assistant", "content": text})
        else:
            out.append(m)
    if tools:
        intro = _tools_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{intro}"}
        else:
            out.insert(0, {"role": "system", "content": intro})
    return out


def _has_tool_turns(messages: list[dict]) -> bool:
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def _call_text(call: dict) -> str:
    fn = call.get("function", {})
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        pass
    return f"{OPEN}\n{json.dumps({'name': fn.get('name'), 'arguments': args})}\n{CLOSE}"


def _tools_text(tools: list[dict]) -> str:
    listed = "\n".join(json.dumps(t) for t in tools)
    return (
        "You can call the tools below. To call one, answer with a JSON object naming it and "
        f"giving its arguments, between {OPEN} and {CLOSE} tags, like this:\n"
        f'{OPEN}\n{{"name": "tool_name", "arguments": {{"argument": "value"}}}}\n{CLOSE}\n'
        f"Tools:\n<tools>\n{listed}\n</tools>"
    )


def forced_grammar(tools: list[dict], name: str | None) -> str:
    """A grammar for exactly one call: of ``name``, or of any of ``tools`` when None."""
    from lucepy.decode.grammar import lark_grammar

    options = []
    for tool in tools:
        fn = tool["function"]
        if name is not None and fn["name"] != name:
            continue
        params = fn.get("parameters") or {"type": "object"}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema = {"x-guidance": _COMPACT, "anyOf": options}
    return lark_grammar(f'start: "{OPEN}\\n" call "\\n{CLOSE}"\ncall: %json {json.dumps(schema)}')


class ToolCallParser:
    """Splits streamed text into content and complete tool calls (OpenAI ``tool_calls``
    entries). Text that may begin ``<tool_call>`` is held back until it is known."""

    def __init__(self):
        self._pending = ""
        self._inside: str | None = None  # the call text so far, once ``<tool_call>`` was seen
        self.count = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        content, calls = [], []
        pending = self._pending + text
        while pending:
            if self._inside is not None:
                body = self._inside + pending  # the closing tag may span deltas
                end = body.find(CLOSE)
                if end < 0:
                    self._inside, pending = body, ""
                    break
                call = self._finish(body[:end])
                if call is None:  # not a call after all: the model's text, kept as content
                    content.append(OPEN + body[:end] + CLOSE)
                else:
                    calls.append(call)
                self._inside, pending = None, body[end + len(CLOSE) :]
                continue
            start = pending.find(OPEN)
            if start >= 0:
                content.append(pending[:start])
                self._inside, pending = "", pending[start + len(OPEN) :]
                continue
            keep = _partial(pending, OPEN)
            content.append(pending[: len(pending) - keep])
            pending = pending[len(pending) - keep :]
            break
        self._pending = pending
        return "".join(content), calls

    def flush(self) -> tuple[str, list[dict]]:
        """At the end: a call left open, or held text, is content after all."""
        text = self._pending if self._inside is None else OPEN + self._inside + self._pending
        self._pending, self._inside = "", None
        return text, []

    def _finish(self, body: str) -> dict | None:
        try:
            obj = json.loads(body)
            name, args = obj["name"], obj.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            return None
        if not isinstance(name, str):
            return None
        entry = {
            "index": self.count,
            "id": "call_" + uuid.uuid4().hex[:24],
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)},
        }
        self.count += 1
        return entry


def _partial(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0

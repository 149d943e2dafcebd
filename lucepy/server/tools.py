"""Tool calls, in the format the model's chat template speaks.

- Hermes/Qwen (``HERMES``): ``<tool_call>`` + ``{"name": ..., "arguments": {...}}`` +
  ``</tool_call>``. A chat template that knows ``tools`` (Qwen's do) gets them, and the
  conversation's tool calls and results, as Hugging Face passes them. For a template that does not
  (SmolLM2's, plain ChatML), lucepy writes the tools into the system message in this format
  itself, shows earlier calls as the assistant's text, and tool results as user turns inside
  ``<tool_response>`` tags.
- Gemma 4 (``GEMMA4``, a template that writes ``<|tool_call>``): ``<|tool_call>call:NAME{key:
  value,...}<tool_call|>``, strings between ``<|"|>`` marks and keys bare. The results of a call
  are folded into the assistant turn that made it, as ``tool_responses`` (the Gemma 4 prompt
  format; llama.cpp's common/parsers/gemma4.cpp does the same), with the answer after them.
- Forcing: ``tool_choice`` ``required`` or a named function becomes a grammar (one call, with
  arguments that validate against the function's parameters), so the call is decoded, not hoped
  for.
- Parsing: ``ToolCallParser`` cuts the calls out of the streamed text; what is outside them is
  content.
"""

from __future__ import annotations

import copy
import json
import re
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


def forced_grammar(
    tools: list[dict], name: str | None, open_term: str = "", close_term: str = ""
) -> str:
    """A grammar for exactly one call: of ``name``, or of any of ``tools`` when None. The
    markers are matched as ``open_term``/``close_term`` (Lark terms) where given."""
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
    start = f'{open_term or json.dumps(OPEN)} "\\n" call "\\n" {close_term or json.dumps(CLOSE)}'
    return lark_grammar(f"start: {start}\ncall: %json {json.dumps(schema)}")


class ToolFormat:
    """Hermes/Qwen: JSON calls between ``<tool_call>`` tags."""

    name, open, close = "hermes", OPEN, CLOSE
    terms: dict[str, str] = {}  # noqa: RUF012  (a bound copy gets its own)

    @property
    def markers(self) -> tuple[str, ...]:
        return (self.open, self.close)

    def bind(self, tokenizer) -> ToolFormat:
        """This format for one vocabulary: a marker that is a token of its own is matched in
        grammars as that token (llguidance sees user-defined tokens as special, not as text)."""
        bound = copy.copy(self)
        bound.terms = {}
        for marker in self.markers:
            ids = tokenizer.encode(marker, add_bos=False)
            if len(ids) == 1:
                bound.terms[marker] = f"<[{ids[0]}]>"
        return bound

    def term(self, marker: str) -> str:
        """A marker as a Lark term: its token, or its text."""
        return self.terms.get(marker) or json.dumps(marker)

    def render(self, messages: list[dict], tools: list[dict] | None, native: bool) -> list[dict]:
        return template_messages(messages, tools, native)

    def grammar(self, tools: list[dict], name: str | None) -> str:
        return forced_grammar(tools, name, self.term(self.open), self.term(self.close))

    def parse(self, body: str) -> tuple[str, object] | None:
        """(name, arguments) of a call's text between the markers; None if it is not one."""
        try:
            obj = json.loads(body)
            return obj["name"], obj.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            return None


class Gemma4Format(ToolFormat):
    name, open, close = "gemma4", "<|tool_call>", "<tool_call|>"
    quote = '<|"|>'

    @property
    def markers(self) -> tuple[str, ...]:
        return (self.open, self.close, self.quote)

    def render(self, messages: list[dict], tools: list[dict] | None, native: bool) -> list[dict]:
        """Each assistant turn with calls takes the tool results after it as ``tool_responses``
        (named by the call they answer) and the assistant's answer after them as content."""
        out, i = [], 0
        while i < len(messages):
            m = messages[i]
            i += 1
            if m["role"] != "assistant" or not m.get("tool_calls"):
                out.append(m)
                continue
            calls = [_with_mapping_arguments(c) for c in m["tool_calls"]]
            turn, answers = {**m, "tool_calls": calls}, []
            while i < len(messages) and messages[i]["role"] == "tool":
                k, result = len(answers), messages[i]
                name = calls[k]["function"]["name"] if k < len(calls) else None
                answers.append(
                    {
                        "name": name or result.get("tool_call_id", ""),
                        "response": _json_or_text(result.get("content")),
                    }
                )
                i += 1
            if answers:
                turn["tool_responses"] = answers
            after = messages[i] if i < len(messages) else None
            if after and after["role"] == "assistant" and not after.get("tool_calls"):
                if after.get("content"):
                    turn["content"] = after["content"]
                    i += 1
            out.append(turn)
        return out

    def grammar(self, tools: list[dict], name: str | None) -> str:
        """One call: the function's name, then its required parameters in schema order, each
        value of the type the schema gives (strings in quote marks, enums as their choices,
        numbers of at most 12 digits a part, so that a call always ends)."""
        from lucepy.decode.grammar import lark_grammar

        options = []
        for tool in tools:
            fn = tool["function"]
            if name is not None and fn["name"] != name:
                continue
            params = fn.get("parameters") or {}
            props = params.get("properties") or {}
            required = params.get("required", list(props))
            chosen = [k for k in props if k in required]
            parts = [f"{json.dumps(k + ':')} {self._value(props[k])}" for k in chosen]
            body = ' "," '.join(parts)
            options.append(f"{json.dumps(fn['name'] + '{')} {body} {json.dumps('}')}")
        q = self.term(self.quote)
        return lark_grammar(
            f'start: {self.term(self.open)} "call:" call {self.term(self.close)}\n'
            f"call: {' | '.join(f'({o})' for o in options)}\n"
            f'value: str | NUM | "true" | "false" | "null" | dict | list\n'
            f"str: {q} /[^<]*/ {q}\n"
            f'dict: "{{" (pair ("," pair)*)? "}}"\n'
            f'pair: /[A-Za-z_][A-Za-z0-9_]*/ ":" value\n'
            f'list: "[" (value ("," value)*)? "]"\n'
            f"NUM: /-?[0-9]{{1,12}}(\\.[0-9]{{1,12}})?([eE][-+]?[0-9]{{1,3}})?/\n"
            f"INT: /-?[0-9]{{1,12}}/\n"
        )

    def _value(self, schema: dict) -> str:
        q = self.term(self.quote)
        if "enum" in schema:
            return "(" + " | ".join(self._literal(v) for v in schema["enum"]) + ")"
        kind = schema.get("type")
        if kind == "string":
            most = schema.get("maxLength")
            return f"{q} /[^<]{{0,{int(most)}}}/ {q}" if most is not None else "str"
        return {"integer": "INT", "number": "NUM", "boolean": '("true" | "false")'}.get(
            kind, "value"
        )

    def _literal(self, v: object) -> str:
        if isinstance(v, str):
            q = self.term(self.quote)
            return f"{q} {json.dumps(v)} {q}"
        return json.dumps(json.dumps(v))

    def parse(self, body: str) -> tuple[str, object] | None:
        m = re.match(r"call:([^{]+)", body)
        if m is None:
            return None
        try:
            args, end = _GemmaValues(body, self.quote).read(m.end())
        except ValueError:
            return None
        if not isinstance(args, dict) or body[end:].strip():
            return None
        return m.group(1).strip(), args


class _GemmaValues:
    """Gemma 4's value syntax: ``{key:value,...}``, ``[...]``, strings between quote marks,
    JSON numbers, true, false, null."""

    _NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][-+]?\d+)?")

    def __init__(self, text: str, quote: str):
        self.text, self.quote = text, quote

    def read(self, i: int) -> tuple[object, int]:
        t = self.text
        if t.startswith(self.quote, i):
            end = t.find(self.quote, i + len(self.quote))
            if end < 0:
                raise ValueError("an unclosed string")
            return t[i + len(self.quote) : end], end + len(self.quote)
        if t.startswith("{", i):
            out, i = {}, i + 1
            while not t.startswith("}", i):
                colon = t.find(":", i)
                if colon < 0:
                    raise ValueError("a key without a value")
                key = t[i:colon].strip()
                if key.startswith(self.quote) and key.endswith(self.quote):
                    key = key[len(self.quote) : -len(self.quote)]
                out[key], i = self.read(colon + 1)
                i = i + 1 if t.startswith(",", i) else i
                if i >= len(t):
                    raise ValueError("an unclosed object")
            return out, i + 1
        if t.startswith("[", i):
            items, i = [], i + 1
            while not t.startswith("]", i):
                value, i = self.read(i)
                items.append(value)
                i = i + 1 if t.startswith(",", i) else i
                if i >= len(t):
                    raise ValueError("an unclosed list")
            return items, i + 1
        for word, value in (("true", True), ("false", False), ("null", None)):
            if t.startswith(word, i):
                return value, i + len(word)
        m = self._NUMBER.match(t, i)
        if m is None:
            raise ValueError(f"no value at {i}")
        number = m.group(0)
        return (float(number) if m.group(1) or m.group(2) else int(number)), m.end()


def _with_mapping_arguments(call: dict) -> dict:
    fn = call.get("function", {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return call
    return {**call, "function": {**fn, "arguments": args}}


def _json_or_text(content: object) -> object:
    if isinstance(content, str):
        try:
            return json.loads(content)
        except ValueError:
            return content
    return content


HERMES, GEMMA4 = ToolFormat(), Gemma4Format()
FORMATS = {f.name: f for f in (HERMES, GEMMA4)}


def tool_format(template: str | None) -> ToolFormat:
    """The call format a chat template speaks: Gemma 4's if it writes ``<|tool_call>``."""
    return GEMMA4 if template and GEMMA4.open in template else HERMES


class ToolCallParser:
    """Splits streamed text into content and complete tool calls (OpenAI ``tool_calls``
    entries). Text that may begin a call's opening marker is held back until it is known."""

    def __init__(self, fmt: ToolFormat = HERMES):
        self.fmt = fmt
        self._pending = ""
        self._inside: str | None = None  # the call text so far, once ``<tool_call>`` was seen
        self.count = 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        content, calls = [], []
        pending = self._pending + text
        while pending:
            if self._inside is not None:
                body = self._inside + pending  # the closing tag may span deltas
                end = body.find(self.fmt.close)
                if end < 0:
                    self._inside, pending = body, ""
                    break
                call = self._finish(body[:end])
                if call is None:  # not a call after all: the model's text, kept as content
                    content.append(self.fmt.open + body[:end] + self.fmt.close)
                else:
                    calls.append(call)
                self._inside, pending = None, body[end + len(self.fmt.close) :]
                continue
            start = pending.find(self.fmt.open)
            if start >= 0:
                content.append(pending[:start])
                self._inside, pending = "", pending[start + len(self.fmt.open) :]
                continue
            keep = _partial(pending, self.fmt.open)
            content.append(pending[: len(pending) - keep])
            pending = pending[len(pending) - keep :]
            break
        self._pending = pending
        return "".join(content), calls

    def flush(self) -> tuple[str, list[dict]]:
        """At the end: a call left open, or held text, is content after all."""
        text = self._pending
        if self._inside is not None:
            text = self.fmt.open + self._inside + text
        self._pending, self._inside = "", None
        return text, []

    def _finish(self, body: str) -> dict | None:
        call = self.fmt.parse(body)
        if call is None:
            return None
        name, args = call
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

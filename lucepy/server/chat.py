"""Chat messages to prompt text, through the GGUF's own Jinja chat template (sandboxed)."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

from lucepy.errors import PromptError


def _raise(message: str):
    from jinja2 import TemplateError

    raise TemplateError(message)


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    # like transformers' chat templates: no HTML escaping, unlike jinja2's own tojson
    return json.dumps(
        value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys
    )


@lru_cache(maxsize=4)
def _compile(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def chat_text(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The text to encode for ``messages`` (and ``tools``) with the model's own template: less a
    leading BOS, which the tokenizer adds itself where the model wants one. A template that does
    not render tools gets them, and tool turns, as text (server/tools.py)."""
    from lucepy.server.tools import knows_tools, tool_format

    bos, eos = tokenizer.token_text(tokenizer.bos), tokenizer.token_text(tokenizer.eos)
    native = knows_tools(tokenizer.chat_template)
    messages = tool_format(tokenizer.chat_template).render(messages, tools, native)
    text = render_chat(
        tokenizer.chat_template, messages, bos=bos, eos=eos, tools=tools if native else None
    )
    if tokenizer.add_bos and bos and text.startswith(bos):
        text = text[len(bos) :]
    return text


def render_chat(
    template: str | None, messages: list[dict], *, bos: str, eos: str, tools=None
) -> str:
    """The prompt text for ``messages``, ending with the assistant's turn opened."""
    from jinja2 import TemplateError

    if not template:
        raise PromptError(
            "this model's GGUF has no chat template (tokenizer.chat_template); "
            "use /v1/completions with a prompt instead"
        )
    try:
        extra = {"tools": tools} if tools else {}
        return _compile(template).render(
            messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos, **extra
        )
    except TemplateError as err:
        raise PromptError(f"the model's chat template refused these messages: {err}") from None

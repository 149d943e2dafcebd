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


def chat_text(tokenizer, messages: list[dict]) -> str:
    """The text to encode for ``messages`` with the model's own template: less a leading BOS,
    which the tokenizer adds itself where the model wants one."""
    bos, eos = tokenizer.token_text(tokenizer.bos), tokenizer.token_text(tokenizer.eos)
    text = render_chat(tokenizer.chat_template, messages, bos=bos, eos=eos)
    if tokenizer.add_bos and bos and text.startswith(bos):
        text = text[len(bos) :]
    return text


def render_chat(template: str | None, messages: list[dict], *, bos: str, eos: str) -> str:
    """The prompt text for ``messages``, ending with the assistant's turn opened."""
    from jinja2 import TemplateError

    if not template:
        raise PromptError(
            "this model's GGUF has no chat template (tokenizer.chat_template); "
            "use /v1/completions with a prompt instead"
        )
    try:
        return _compile(template).render(
            messages=messages, add_generation_prompt=True, bos_token=bos, eos_token=eos
        )
    except TemplateError as err:
        raise PromptError(f"the model's chat template refused these messages: {err}") from None

"""The ``lucepy`` command. Each command parses flags, calls the Engine API, and renders via tui."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import typer

from lucepy import tui
from lucepy.errors import LucepyError, PromptError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Serve and benchmark GGUF models split across devices.",
)


def _run(fn):
    """Run a command body; a LucepyError becomes one line on stderr and exit status 1."""
    try:
        return fn()
    except LucepyError as err:
        tui.error(str(err))
        raise typer.Exit(1) from None


@app.callback()
def main(verbose: Annotated[bool, typer.Option("--verbose", "-v", help="debug logging")] = False):
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )


@app.command()
def devices(as_json: Annotated[bool, typer.Option("--json", help="print JSON")] = False):
    """List the ggml backends and devices of this install, with their memory."""

    def body():
        from lucepy.ggml import load
        from lucepy.runtime.devices import list_devices

        found = list_devices(load())
        if as_json:
            tui.print_json(json.dumps({"devices": [d.to_dict() for d in found]}))
        else:
            tui.show(tui.devices_table(found))

    _run(body)


def _parse_tokens(text: str) -> list[int]:
    try:
        tokens = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise PromptError(f"--prompt-tokens takes comma-separated integers, got {text!r}") from None
    if not tokens:
        raise PromptError("--prompt-tokens is empty")
    return tokens


@app.command()
def generate(
    model: Annotated[Path, typer.Argument(help="a GGUF model file")],
    prompt: Annotated[str | None, typer.Option(help="prompt text")] = None,
    prompt_tokens: Annotated[str | None, typer.Option(help="prompt as token ids: 1,2,3")] = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="tokens to generate")] = 64,
    chunk: Annotated[int, typer.Option(min=1, help="prefill batch size")] = 512,
    device: Annotated[str, typer.Option(help="device to run on (see `lucepy devices`)")] = "cpu",
    max_ctx: Annotated[int | None, typer.Option(help="context size in tokens")] = None,
    threads: Annotated[int | None, typer.Option(min=1, help="CPU threads")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
):
    """Generate greedily from a prompt."""

    def body():
        from lucepy.decode.ar import generate as run_generate
        from lucepy.runtime.config import RuntimeConfig
        from lucepy.runtime.engine import Engine

        if (prompt is None) == (prompt_tokens is None):
            raise PromptError("give exactly one of --prompt TEXT or --prompt-tokens 1,2,3")
        config = RuntimeConfig(device=device, max_ctx=max_ctx, chunk=chunk, threads=threads)
        with Engine(model, config) as engine:
            tokens = (
                engine.tokenizer.encode(prompt)
                if prompt is not None
                else _parse_tokens(prompt_tokens)
            )
            gen = run_generate(engine, tokens, max_tokens, chunk=chunk)
        if as_json:
            tui.print_json(json.dumps(gen.to_dict()))
        else:
            tui.generation(gen)

    _run(body)


@app.command()
def bench(
    model: Annotated[Path, typer.Argument(help="a GGUF model file")],
    prompt_len: Annotated[int, typer.Option(min=1, help="prompt tokens for prefill")] = 512,
    gen: Annotated[int, typer.Option(min=1, help="tokens to decode")] = 64,
    chunk: Annotated[int, typer.Option(min=1, help="prefill batch size")] = 512,
    threads: Annotated[int | None, typer.Option(min=1, help="CPU threads")] = None,
    repeats: Annotated[int, typer.Option(min=1, help="timed runs; the median is reported")] = 3,
    vs_llama_cpp: Annotated[
        bool, typer.Option("--vs-llama-cpp/--no-llama-cpp", help="measure llama.cpp too")
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
):
    """Prefill and decode tokens/s, side by side with llama.cpp on the same GGUF."""

    def body():
        from lucepy import bench as bench_mod

        result = bench_mod.run(
            model,
            prompt_len=prompt_len,
            gen=gen,
            threads=threads,
            chunk=chunk,
            vs_llama_cpp=vs_llama_cpp,
            repeats=repeats,
        )
        if as_json:
            tui.print_json(json.dumps(result.to_dict()))
        else:
            tui.show(tui.bench_table(result))

    _run(body)


if __name__ == "__main__":
    app()

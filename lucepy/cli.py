"""The ``lucepy`` command. Each command parses flags, calls the Engine API, and renders via tui."""

from __future__ import annotations

import contextlib
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


TargetDevices = Annotated[
    str,
    typer.Option(
        "--target-devices",
        "--device",
        help="devices, one shard each: cpu, cuda:0,cuda:1, cuda:0,hip:0, cpu,cpu@worker, "
        "cuda:0,rpc://HOST:PORT",
    ),
]
LayerSplit = Annotated[
    str | None,
    typer.Option("--target-layer-split", help="layer split weights, one per device: 0.3,0.7"),
]
MaxCtx = Annotated[int | None, typer.Option(min=1, help="context size in tokens")]
Chunk = Annotated[int, typer.Option(min=1, help="prefill batch size")]
Threads = Annotated[int | None, typer.Option(min=1, help="CPU threads")]
AsJson = Annotated[bool, typer.Option("--json", help="print one JSON object")]
Draft = Annotated[Path | None, typer.Option(help="a DFlash draft GGUF: speculative decoding")]
DraftDevice = Annotated[
    str | None,
    typer.Option(help="device for the draft (default: the last target shard's, if local)"),
]
DraftBlock = Annotated[int | None, typer.Option(min=2, help="draft block size (default: trained)")]
Temperature = Annotated[float, typer.Option(min=0.0, help="sampling temperature; 0 is greedy")]
TopP = Annotated[float, typer.Option(min=0.0, max=1.0, help="nucleus sampling mass")]
TopK = Annotated[int, typer.Option(min=0, help="sample among the k most likely; 0: all")]
Seed = Annotated[int | None, typer.Option(help="sampling seed")]


def runtime_config(
    target_devices: str = "cpu",
    layer_split: str | None = None,
    max_ctx: int | None = None,
    chunk: int = 512,
    threads: int | None = None,
    draft: Path | None = None,
    draft_device: str | None = None,
    draft_block: int | None = None,
):
    """The one place CLI flags become a RuntimeConfig (generate, bench, plan, serve)."""
    from lucepy.runtime.config import RuntimeConfig

    return RuntimeConfig(
        device=target_devices,
        layer_split=layer_split,
        max_ctx=max_ctx,
        chunk=chunk,
        threads=threads,
        draft=str(draft) if draft else None,
        draft_device=draft_device,
        draft_block=draft_block,
    )


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
    chunk: Chunk = 512,
    target_devices: TargetDevices = "cpu",
    target_layer_split: LayerSplit = None,
    max_ctx: MaxCtx = None,
    threads: Threads = None,
    draft: Draft = None,
    draft_device: DraftDevice = None,
    draft_block: DraftBlock = None,
    temperature: Temperature = 0.0,
    top_p: TopP = 1.0,
    top_k: TopK = 0,
    seed: Seed = None,
    as_json: AsJson = False,
):
    """Generate from a prompt: greedy by default, speculative with --draft."""

    def body():
        from lucepy.decode.ar import generate as run_generate
        from lucepy.decode.sampling import SamplingParams
        from lucepy.runtime.engine import Engine

        if (prompt is None) == (prompt_tokens is None):
            raise PromptError("give exactly one of --prompt TEXT or --prompt-tokens 1,2,3")
        sampling = SamplingParams(temperature, top_k, top_p, seed)
        config = runtime_config(
            target_devices,
            target_layer_split,
            max_ctx,
            chunk,
            threads,
            draft,
            draft_device,
            draft_block,
        )
        with Engine(model, config) as engine:
            if prompt is not None:
                tokens = engine.tokenizer.encode(prompt)
            else:
                tokens = _parse_tokens(prompt_tokens)
            gen = run_generate(engine, tokens, max_tokens, sampling=sampling, chunk=chunk)
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
    chunk: Chunk = 512,
    target_devices: TargetDevices = "cpu",
    target_layer_split: LayerSplit = None,
    threads: Threads = None,
    repeats: Annotated[int, typer.Option(min=1, help="timed runs; the median is reported")] = 3,
    vs_llama_cpp: Annotated[
        bool, typer.Option("--vs-llama-cpp/--no-llama-cpp", help="measure llama.cpp too")
    ] = True,
    as_json: AsJson = False,
):
    """Prefill and decode tokens/s, side by side with llama.cpp on the same GGUF."""

    def body():
        from lucepy import bench as bench_mod

        config = runtime_config(
            target_devices, target_layer_split, prompt_len + gen + 1, chunk, threads
        )
        result = bench_mod.run(
            model,
            config,
            prompt_len=prompt_len,
            gen=gen,
            vs_llama_cpp=vs_llama_cpp,
            repeats=repeats,
        )
        if as_json:
            tui.print_json(json.dumps(result.to_dict()))
        else:
            tui.show(tui.bench_table(result))

    _run(body)


@app.command()
def plan(
    model: Annotated[Path, typer.Argument(help="a GGUF model file")],
    target_devices: TargetDevices = "cpu",
    target_layer_split: LayerSplit = None,
    max_ctx: MaxCtx = None,
    as_json: AsJson = False,
):
    """Print the load plan (devices, layer ranges, bytes) without loading any weights."""

    def body():
        from lucepy.ggml import load
        from lucepy.gguf import GGUFFile
        from lucepy.models import architecture_for
        from lucepy.runtime.engine import make_plan

        config = runtime_config(target_devices, target_layer_split, max_ctx)
        with GGUFFile(model) as f:
            result = make_plan(f, architecture_for(f).from_gguf(f), config, load())
        if as_json:
            tui.print_json(json.dumps(result.to_dict()))
        else:
            tui.show(tui.plan_table(result))

    _run(body)


@app.command()
def worker(
    device: Annotated[str, typer.Option(help="the device to serve, e.g. cpu or cuda:0")] = "cpu",
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="port to listen on")] = 50052,
    ggml: Annotated[Path | None, typer.Option(help="ggml build directory to use")] = None,
    threads: Threads = None,
):
    """Serve a device of this (or --ggml's) ggml build over ggml-rpc, until stopped."""

    def body():
        import os

        if ggml is not None:
            os.environ["LUCEPY_GGML_LIB"] = str(ggml)
        from lucepy.ggml import load
        from lucepy.runtime.workers import serve

        serve(load(), device, host, port, threads or os.cpu_count() or 1)

    _run(body)


backends_app = typer.Typer(help="ggml builds, one per backend.", no_args_is_help=True)
app.add_typer(backends_app, name="backends")


@backends_app.command("build")
def backends_build(
    backend: Annotated[str, typer.Argument(help="cpu, cuda, hip or vulkan")],
    prefix: Annotated[Path | None, typer.Option(help="install directory")] = None,
    arch: Annotated[str | None, typer.Option(help="GPU architectures, e.g. 90 or gfx1100")] = None,
    sdist: Annotated[Path | None, typer.Option(help="the pinned sdist, if offline")] = None,
    with_llama_bench: Annotated[bool, typer.Option(help="also build llama-bench")] = False,
    dry_run: Annotated[bool, typer.Option(help="print the commands only")] = False,
):
    """Build the pinned ggml for BACKEND (with RPC) into its own directory."""

    def body():
        from lucepy.runtime import backends

        bplan = backends.plan_build(backend, prefix, arch, with_llama_bench)
        tui.show(tui.build_plan(bplan))
        if not dry_run:
            with tui.status(f"building ggml for {backend} ({bplan.jobs} jobs)"):
                backends.build(bplan, sdist)
            tui.show(f"built into {bplan.prefix}; use it with LUCEPY_GGML_LIB={bplan.prefix}")

    _run(body)


@backends_app.command("list")
def backends_list(as_json: AsJson = False):
    """List the ggml builds lucepy finds."""

    def body():
        from lucepy.runtime import backends

        builds = backends.list_builds()
        if as_json:
            tui.print_json(
                json.dumps({"builds": [{"backend": b, "path": str(p)} for b, p in builds]})
            )
        else:
            tui.show(tui.builds_table(builds, backends.cache_root() / "ggml"))

    _run(body)


ApiKey = Annotated[
    str | None, typer.Option(envvar="LUCEPY_API_KEY", help="API key clients send as Bearer")
]


@app.command()
def serve(
    model: Annotated[
        str | None,
        typer.Argument(help="a GGUF file or a models.yaml name; default: the built-in tiny model"),
    ] = None,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="port to listen on")] = 8080,
    api_key: ApiKey = None,
    live: Annotated[bool, typer.Option("--tui", help="show a live status view")] = False,
    target_devices: TargetDevices = None,
    target_layer_split: LayerSplit = None,
    max_ctx: MaxCtx = None,
    chunk: Chunk = 512,
    threads: Threads = None,
):
    """Serve MODEL with an OpenAI-compatible API (/v1/chat/completions, /v1/completions)."""

    def body():
        from lucepy import catalog
        from lucepy.server.run import Server

        found = catalog.resolve(model, catalog.load_catalog(), progress=tui.status)
        flags = (target_devices, target_layer_split, max_ctx, chunk, threads)
        engine = _open_engine(found, *flags)
        level = "warning" if live else "info"
        server = Server(
            engine, name=found.name, host=host, port=port, api_key=api_key, log_level=level
        )
        tui.note(f"serving {found.name} on {server.url} (Ctrl-C stops)")
        if live:
            _serve_live(server)
        else:
            with contextlib.suppress(KeyboardInterrupt):
                server.run()

    _run(body)


def _open_engine(found, target_devices, target_layer_split, max_ctx, chunk, threads):
    """The Engine for a resolved model; flags win over its models.yaml entry's defaults."""
    from lucepy.runtime.engine import Engine

    entry = found.entry
    devices = target_devices or (",".join(entry.placement) if entry else "") or "cpu"
    context = max_ctx or (entry.context if entry else None)
    config = runtime_config(devices, target_layer_split, context, chunk, threads)
    with tui.status(f"loading {found.name} ({found.path.name}) on {config.device}"):
        return Engine(found.path, config)


def _serve_live(server) -> None:
    import signal

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM stops as Ctrl-C does
    server.start()
    url = server.url
    try:
        tui.watch(lambda: tui.status_view(server.status(), url))
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


@app.command()
def models(as_json: AsJson = False):
    """List the named models (models.yaml and the built-in tiny one)."""

    def body():
        from lucepy import catalog

        cat = catalog.load_catalog()
        rows = catalog.listing(cat)
        source = str(cat.path) if cat.path else None
        if as_json:
            tui.print_json(json.dumps({"source": source, "default": cat.default, "models": rows}))
        else:
            tui.show(tui.models_table(rows, source))

    _run(body)


@app.command()
def top(
    url: Annotated[str, typer.Argument(help="a lucepy server")] = "http://127.0.0.1:8080",
    api_key: ApiKey = None,
    interval: Annotated[float, typer.Option(min=0.1, help="seconds between updates")] = 1.0,
    once: Annotated[bool, typer.Option("--once", help="print one view and exit")] = False,
):
    """Watch a running `lucepy serve`: placement, tokens/s, queue, requests."""

    def body():
        from lucepy.errors import ServerUnreachable
        from lucepy.server.client import fetch_status

        first = tui.status_view(fetch_status(url, api_key), url)  # fails in one line if down
        if once:
            tui.show(first)
            return

        def frame():
            try:
                return tui.status_view(fetch_status(url, api_key), url)
            except ServerUnreachable as err:
                return tui.unreachable_view(str(err), url)

        with contextlib.suppress(KeyboardInterrupt):
            tui.watch(frame, interval)

    _run(body)


if __name__ == "__main__":
    app()

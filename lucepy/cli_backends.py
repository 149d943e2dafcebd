"""``lucepy worker`` and ``lucepy backends``: ggml builds and the ggml-rpc servers that host them.

Registered on :data:`lucepy.cli.app` when that module is imported."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from lucepy import tui
from lucepy.cli import app, run_body
from lucepy.cli_options import AsJson, Threads


@app.command()
def worker(
    device: Annotated[str, typer.Option(help="the device to serve, e.g. cpu or cuda:0")] = "cpu",
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="port to listen on")] = 50052,
    ggml: Annotated[Path | None, typer.Option(help="ggml build directory to use")] = None,
    threads: Threads = None,
    parent_fd: Annotated[int | None, typer.Option(hidden=True)] = None,
    log_file: Annotated[Path | None, typer.Option(hidden=True)] = None,
):
    """Serve a device of this (or --ggml's) ggml build over ggml-rpc, until stopped."""

    def body():
        import os

        if ggml is not None:
            os.environ["LUCEPY_GGML_LIB"] = str(ggml)
        from lucepy.ggml import load
        from lucepy.runtime.workers import exit_with_parent, serve

        if parent_fd is not None:  # spawned by lucepy: end with the spawning process
            exit_with_parent(parent_fd, log_file)

        serve(load(), device, host, port, threads or os.cpu_count() or 1)

    run_body(body)


backends_app = typer.Typer(help="ggml builds, one per backend.", no_args_is_help=True)
app.add_typer(backends_app, name="backends")


@backends_app.command("build")
def backends_build(
    backend: Annotated[str, typer.Argument(help="cpu, cuda, hip or vulkan")],
    prefix: Annotated[Path | None, typer.Option(help="install directory")] = None,
    arch: Annotated[str | None, typer.Option(help="GPU architectures, e.g. 90 or gfx1100")] = None,
    sdist: Annotated[Path | None, typer.Option(help="the pinned sdist, if offline")] = None,
    with_llama_bench: Annotated[bool, typer.Option(help="also build llama-bench")] = False,
    kernels: Annotated[
        str | None,
        typer.Option(
            help="lucepy: with lucepy's own kernels (cuda's default); ggml: ggml's only, "
            "into BACKEND-ggml unless --prefix says"
        ),
    ] = None,
    dry_run: Annotated[bool, typer.Option(help="print the commands only")] = False,
):
    """Build the pinned ggml for BACKEND (with RPC) into its own directory."""

    def body():
        from lucepy.runtime import backends

        bplan = backends.plan_build(backend, prefix, arch, with_llama_bench, kernels=kernels)
        tui.show(tui.build_plan(bplan))
        if not dry_run:
            with tui.status(f"building ggml for {backend} ({bplan.jobs} jobs)"):
                backends.build(bplan, sdist)
            tui.show(f"built into {bplan.prefix}; use it with LUCEPY_GGML_LIB={bplan.prefix}")

    run_body(body)


@backends_app.command("list")
def backends_list(as_json: AsJson = False):
    """List the ggml builds lucepy finds."""

    def body():
        from lucepy.runtime import backends

        builds = backends.list_builds()
        if as_json:
            rows = [
                {"backend": b, "path": str(p), "kernels": backends.build_kernels(p)}
                for b, p in builds
            ]
            tui.print_json(json.dumps({"builds": rows}))
        else:
            kernels = [backends.build_kernels(p) for _, p in builds]
            tui.show(tui.builds_table(builds, kernels, backends.cache_root() / "ggml"))

    run_body(body)

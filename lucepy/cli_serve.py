"""``lucepy serve``, ``lucepy models`` and ``lucepy top``: serving named models over HTTP.

Registered on :data:`lucepy.cli.app` when that module is imported."""

from __future__ import annotations

import contextlib
import json
from typing import Annotated

import typer

from lucepy import tui
from lucepy.cli import app, run_body
from lucepy.cli_options import (
    DEFAULTS,
    AsJson,
    BatchInvariant,
    CacheFlags,
    CacheMB,
    CacheSlots,
    CacheTypeK,
    CacheTypeV,
    Chunk,
    ColdExperts,
    ComputeFlags,
    DiskPolicy,
    Draft,
    DraftBlock,
    DraftDevice,
    ExpertProfile,
    FlashAttn,
    KVCacheBudget,
    KVCacheDir,
    KvPool,
    KvPoolRank,
    LayerSplit,
    MaxCtx,
    MoeDeviceMB,
    NCpuMoe,
    Parallel,
    TargetDevices,
    Threads,
    runtime_config,
)

ApiKey = Annotated[
    str | None, typer.Option(envvar="LUCEPY_API_KEY", help="API key clients send as Bearer")
]


@app.command()
def serve(
    model: Annotated[
        str | None,
        typer.Argument(help="a GGUF file or a models.yaml name; default: smollm2-135m-instruct"),
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
    flash_attn: FlashAttn = True,
    cache_type_k: CacheTypeK = DEFAULTS.cache_type_k,
    cache_type_v: CacheTypeV = DEFAULTS.cache_type_v,
    draft: Draft = None,
    draft_device: DraftDevice = None,
    draft_block: DraftBlock = "auto",
    prefix_cache_slots: CacheSlots = DEFAULTS.prefix_cache_slots,
    prefix_cache_mb: CacheMB = DEFAULTS.prefix_cache_mb,
    kv_cache_dir: KVCacheDir = None,
    kv_cache_budget: KVCacheBudget = DEFAULTS.kv_cache_budget_mb,
    disk_prefix_cache: DiskPolicy = DEFAULTS.disk_prefix_cache,
    moe_gpu_mb: MoeDeviceMB = None,
    n_cpu_moe: NCpuMoe = 0,
    cold_experts: ColdExperts = DEFAULTS.cold_experts,
    expert_profile: ExpertProfile = None,
    kv_pool: KvPool = 0,
    kv_pool_rank: KvPoolRank = DEFAULTS.kv_pool_rank,
    batch_invariant: BatchInvariant = False,
    parallel: Parallel = 1,
):
    """Serve MODEL with an OpenAI-compatible API (/v1/chat/completions, /v1/completions)."""
    cache = CacheFlags(
        prefix_cache_slots, prefix_cache_mb, kv_cache_dir, kv_cache_budget, disk_prefix_cache
    )

    def body():
        from lucepy.server.run import Server

        compute = ComputeFlags(
            flash_attn, cache_type_k, cache_type_v, moe_gpu_mb, n_cpu_moe, expert_profile, True,
            kv_pool, kv_pool_rank, batch_invariant, parallel, cold_experts,
        )  # fmt: skip
        placement = (target_devices, target_layer_split, max_ctx, chunk, threads, compute)
        found, engine = open_model(model, placement, (draft, draft_device, draft_block), cache)
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

    run_body(body)


def open_model(model: str | None, placement: tuple, drafting: tuple, cache: CacheFlags):
    """MODEL as serve and generate take it (a GGUF path, a models.yaml name, or None for the
    default) resolved and loaded: ``(ResolvedModel, Engine)``. Flags win over the entry's
    defaults (placement, context, draft)."""
    from lucepy import catalog

    found = catalog.resolve(model, catalog.load_catalog(), progress=tui.status)
    return found, _open_engine(found, placement, drafting, cache)


def _open_engine(found, placement: tuple, drafting: tuple, cache: CacheFlags):
    from lucepy.engine import open_engine

    target_devices, target_layer_split, max_ctx, chunk, threads, compute = placement
    draft, draft_device, draft_block = drafting
    entry = found.entry
    devices = target_devices or (",".join(entry.placement) if entry else "") or "cpu"
    context = max_ctx or (entry.context if entry else None)
    draft = found.draft_path(draft)
    config = runtime_config(
        devices,
        target_layer_split,
        context,
        chunk,
        threads,
        draft,
        draft_device,
        draft_block,
        cache,
        compute,
    )
    what = f"{found.path.name} + draft {draft.name}" if draft else found.path.name
    with tui.status(f"loading {found.name} ({what}) on {config.device}"):
        engine = open_engine(found.path, config)
    try:
        with tui.status("timing the draft's verify lengths (once per device, then cached)"):
            engine.verify_lengths()  # at load, not in the first request's time to first token
    except BaseException:
        engine.close()
        raise
    return engine


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
    """List the named models (models.yaml and the built-in ones)."""

    def body():
        from lucepy import catalog

        cat = catalog.load_catalog()
        rows = catalog.listing(cat)
        source = str(cat.path) if cat.path else None
        if as_json:
            tui.print_json(json.dumps({"source": source, "default": cat.default, "models": rows}))
        else:
            tui.show(tui.models_table(rows, source))

    run_body(body)


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

    run_body(body)

"""The ``lucepy`` command. Each command parses flags, calls the Engine API, and renders via tui.

This module holds the app and generate/bench/plan/devices; the options the commands share are in
``cli_options``; serve/models/top live in ``cli_serve`` and worker/backends in ``cli_backends``,
registered on the same app.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import typer

from lucepy import tui
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
    Seed,
    TargetDevices,
    Temperature,
    Threads,
    TopK,
    TopP,
    runtime_config,
)
from lucepy.errors import ConfigError, LucepyError, PromptError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Serve and benchmark GGUF models split across devices.",
)


def run_body(fn):
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

    run_body(body)


def chat_prompt(tokenizer, prompt: str, system: str | None) -> str:
    """``prompt`` as a user turn (after ``system``) through the model's own chat template."""
    from lucepy.server.chat import chat_text

    messages = [{"role": "user", "content": prompt}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return chat_text(tokenizer, messages)


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
    model: Annotated[
        str | None,
        typer.Argument(help="a GGUF file or a models.yaml name; default: smollm2-135m-instruct"),
    ] = None,
    prompt: Annotated[str | None, typer.Option(help="prompt text, raw unless --chat")] = None,
    chat: Annotated[
        bool, typer.Option("--chat", help="send --prompt as a user turn of the chat template")
    ] = False,
    system: Annotated[str | None, typer.Option(help="a system message (implies --chat)")] = None,
    prompt_tokens: Annotated[str | None, typer.Option(help="prompt as token ids: 1,2,3")] = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="tokens to generate")] = 64,
    chunk: Chunk = 512,
    target_devices: TargetDevices = None,
    target_layer_split: LayerSplit = None,
    max_ctx: MaxCtx = None,
    threads: Threads = None,
    flash_attn: FlashAttn = True,
    cache_type_k: CacheTypeK = DEFAULTS.cache_type_k,
    cache_type_v: CacheTypeV = DEFAULTS.cache_type_v,
    draft: Draft = None,
    draft_device: DraftDevice = None,
    draft_block: DraftBlock = "auto",
    temperature: Temperature = 0.0,
    top_p: TopP = 1.0,
    top_k: TopK = 0,
    seed: Seed = None,
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
    as_json: AsJson = False,
):
    """Generate from a prompt: greedy by default, speculative with a draft (--draft or the
    models.yaml entry's)."""
    cache = CacheFlags(
        prefix_cache_slots, prefix_cache_mb, kv_cache_dir, kv_cache_budget, disk_prefix_cache
    )

    def body():
        from lucepy.cli_serve import open_model
        from lucepy.decode.sampling import SamplingParams

        if (prompt is None) == (prompt_tokens is None):
            raise PromptError("give exactly one of --prompt TEXT or --prompt-tokens 1,2,3")
        sampling = SamplingParams(temperature, top_k, top_p, seed)
        compute = ComputeFlags(
            flash_attn, cache_type_k, cache_type_v, moe_gpu_mb, n_cpu_moe, expert_profile, True,
            kv_pool, kv_pool_rank, batch_invariant, cold_experts=cold_experts,
        )  # fmt: skip
        placement = (target_devices, target_layer_split, max_ctx, chunk, threads, compute)
        _, engine = open_model(model, placement, (draft, draft_device, draft_block), cache)
        with engine:
            if prompt is not None and (chat or system is not None):
                tokens = engine.tokenizer.encode(chat_prompt(engine.tokenizer, prompt, system))
            elif prompt is not None:
                tokens = engine.tokenizer.encode(prompt)
            else:
                tokens = _parse_tokens(prompt_tokens)
            gen = engine.generate(tokens, max_tokens, sampling=sampling, chunk=chunk)
        if as_json:
            tui.print_json(json.dumps(gen.to_dict()))
        else:
            tui.generation(gen)

    run_body(body)


@app.command()
def bench(
    model: Annotated[Path, typer.Argument(help="a GGUF model file")],
    prompt_len: Annotated[int, typer.Option(min=1, help="prompt tokens for prefill")] = 512,
    gen: Annotated[int, typer.Option(min=1, help="tokens to decode")] = 64,
    chunk: Chunk = 512,
    target_devices: TargetDevices = "cpu",
    target_layer_split: LayerSplit = None,
    threads: Threads = None,
    flash_attn: FlashAttn = True,
    cache_type_k: CacheTypeK = DEFAULTS.cache_type_k,
    cache_type_v: CacheTypeV = DEFAULTS.cache_type_v,
    repeats: Annotated[int, typer.Option(min=1, help="timed runs; the median is reported")] = 3,
    vs_llama_cpp: Annotated[
        bool, typer.Option("--vs-llama-cpp/--no-llama-cpp", help="measure llama.cpp too")
    ] = True,
    prefix_cache_slots: CacheSlots = DEFAULTS.prefix_cache_slots,
    prefix_cache_mb: CacheMB = DEFAULTS.prefix_cache_mb,
    kv_cache_dir: KVCacheDir = None,
    kv_cache_budget: KVCacheBudget = DEFAULTS.kv_cache_budget_mb,
    disk_prefix_cache: DiskPolicy = DEFAULTS.disk_prefix_cache,
    as_json: AsJson = False,
):
    """Prefill and decode tokens/s, side by side with llama.cpp on the same GGUF."""
    cache = CacheFlags(
        prefix_cache_slots, prefix_cache_mb, kv_cache_dir, kv_cache_budget, disk_prefix_cache
    )

    def body():
        from lucepy import bench as bench_mod

        config = runtime_config(
            target_devices,
            target_layer_split,
            prompt_len + gen + 1,
            chunk,
            threads,
            cache=cache,
            compute=ComputeFlags(flash_attn, cache_type_k, cache_type_v),
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

    run_body(body)


@app.command()
def plan(
    model: Annotated[Path, typer.Argument(help="a GGUF model file")],
    target_devices: TargetDevices = "cpu",
    target_layer_split: LayerSplit = None,
    max_ctx: MaxCtx = None,
    moe_gpu_mb: MoeDeviceMB = None,
    n_cpu_moe: NCpuMoe = 0,
    cold_experts: ColdExperts = DEFAULTS.cold_experts,
    expert_profile: ExpertProfile = None,
    kv_pool: KvPool = 0,
    kv_pool_rank: KvPoolRank = DEFAULTS.kv_pool_rank,
    parallel: Parallel = 1,
    as_json: AsJson = False,
):
    """Print the load plan (devices, layer ranges, bytes, where the experts go) without loading
    any weights."""

    def body():
        from lucepy.ggml import load
        from lucepy.gguf import GGUFFile
        from lucepy.models import architecture_for
        from lucepy.runtime.plan import make_plan, model_options

        moe = ComputeFlags(
            moe_device_mb=moe_gpu_mb,
            n_cpu_moe=n_cpu_moe,
            cold_experts=cold_experts,
            kv_pool=kv_pool,
            kv_pool_rank=kv_pool_rank,
            parallel=parallel,
        )
        config = runtime_config(
            target_devices, target_layer_split, max_ctx,
            compute=moe._replace(expert_profile=expert_profile),
        )  # fmt: skip
        with GGUFFile(model) as f:
            arch = architecture_for(f).from_gguf(f, model_options(config))
            result = make_plan(f, arch, config, load())
        if as_json:
            tui.print_json(json.dumps(result.to_dict()))
        else:
            tui.show(tui.plan_table(result))

    run_body(body)


@app.command()
def experts(
    model: Annotated[Path, typer.Argument(help="a GGUF model file with routed experts")],
    expert_profile: ExpertProfile = None,
    top: Annotated[int, typer.Option(min=1, help="experts shown per layer")] = 8,
    as_json: AsJson = False,
):
    """Show the expert hotness profile: per layer, the experts most tokens chose (counted by
    `lucepy serve` and `lucepy generate`; the placement of --moe-gpu-mb follows it)."""

    def body():
        from lucepy.gguf import GGUFFile
        from lucepy.models import architecture_for
        from lucepy.runtime import experts as ex

        with GGUFFile(model) as f:
            p = architecture_for(f).from_gguf(f).p
            if not getattr(p, "n_expert", 0):
                raise ConfigError(f"{model}: this model has no routed experts")
            path = Path(expert_profile) if expert_profile else ex.profile_path(f)
        counts = ex.ExpertCounts.load(path, p.n_layer, p.n_expert).counts
        if not counts.any():
            raise ConfigError(
                f"no expert profile at {path} yet: serve or generate with this model to count"
            )
        report = ex.report(counts, p.n_expert_used, top)
        if as_json:
            tui.print_json(json.dumps({"profile": str(path), **report}))
        else:
            tui.show(tui.experts_table(report, str(path)))

    run_body(body)


# Importing these registers their commands on `app` (they import `app` from here).
from lucepy import cli_backends, cli_serve  # noqa: E402, F401

if __name__ == "__main__":  # `python -m lucepy.cli`: the app the other modules registered on
    from lucepy.cli import app as registered

    registered()

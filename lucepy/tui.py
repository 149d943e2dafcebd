"""All rich rendering lives here, behind one Console."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table

console = Console()
err_console = Console(stderr=True)


def error(message: str) -> None:
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def devices_table(devices: list) -> Table:
    table = Table(title="ggml devices")
    for col in ("device", "backend", "ggml name", "kind", "free", "total", "description"):
        table.add_column(col)
    for d in devices:
        table.add_row(
            d.name,
            d.backend,
            d.ggml_name,
            d.kind,
            _gib(d.memory_free),
            _gib(d.memory_total),
            d.description,
        )
    return table


def generation(gen) -> None:
    console.print(gen.text, highlight=False, markup=False)
    t = gen.timings
    err_console.print(
        f"[dim]prompt {len(gen.prompt_tokens)} tok: {t.prefill_tok_s:.1f} tok/s · "
        f"generated {len(gen.tokens)} tok: {t.decode_tok_s:.1f} tok/s[/]"
    )


def bench_table(result) -> Table:
    table = Table(
        title=f"{result.model}: prompt {result.prompt_len}, gen {result.gen}, "
        f"{result.threads} threads"
    )
    for col in ("", "lucepy tok/s", "llama.cpp tok/s", "ratio"):
        table.add_column(col, justify="right")
    ratios = result.ratios or {}
    for phase in ("prefill", "decode"):
        ours = getattr(result.lucepy, f"{phase}_tok_s")
        ref = getattr(result.llama_cpp, f"{phase}_tok_s") if result.llama_cpp else None
        table.add_row(
            phase,
            f"{ours:.1f}",
            "-" if ref is None else f"{ref:.1f}",
            f"{ratios[phase]:.2f}x" if phase in ratios else "-",
        )
    return table


def _bar(part: int, whole: int, width: int = 20) -> str:
    filled = round(width * part / whole) if whole else 0
    return "█" * filled + "░" * (width - filled)


def placement_table(shards: list[dict], title: str = "placement") -> Table:
    """Shard placement: one row per shard, with a memory bar of its share of the total."""
    table = Table(title=title)
    for col in ("shard", "device", "backend", "layers", "weights", "KV + state", "process", ""):
        table.add_column(col)
    total = sum(s["weight_bytes"] + s["state_bytes"] for s in shards)
    for i, s in enumerate(shards):
        a, b = s["layers"]
        mine = s["weight_bytes"] + s["state_bytes"]
        table.add_row(
            str(i),
            s["device"],
            s["backend"],
            f"{a}–{b - 1} ({b - a})",
            _mib(s["weight_bytes"]),
            _mib(s["state_bytes"]),
            s["process"],
            _bar(mine, total),
        )
    return table


def plan_table(plan) -> Table:
    table = placement_table(
        [s.to_dict() for s in plan.shards],
        title=f"{plan.model}: {plan.n_layer} layers, context {plan.max_ctx}"
        + (f" for each of {plan.parallel} sequences" if plan.parallel > 1 else ""),
    )
    lines = list(plan.notes)
    aligned = tuple(s.layers for s in plan.shards)
    if plan.requested and tuple(plan.requested) != aligned:
        show = lambda ranges: ", ".join(f"{a}–{b - 1}" for a, b in ranges)  # noqa: E731
        lines.insert(0, f"requested layers {show(plan.requested)}; aligned {show(aligned)}")
    if plan.memory:
        lines.append(plan.memory)
    if plan.experts is not None:
        device, host = plan.experts.bytes()
        split = sorted(plan.experts.hot)
        kept = [f"{il}: {len(plan.experts.hot[il])}" for il in split[:8]]
        more = ", ..." if len(split) > 8 else ""
        lines.append(
            f"experts: {plan.experts.policy}; {_mib(device)} on the device, {_mib(host)} in host "
            f"RAM ({'read by the device' if plan.experts.reads else 'computed by the CPU'}); "
            f"{len(split)} layers split"
            + (f" (experts kept: {', '.join(kept)}{more})" if split else "")
        )
    if plan.kv_pool:
        lines.append(pool_line(plan.kv_pool))
    if lines:
        table.caption = "\n".join(lines)
    return table


def pool_line(pool: dict) -> str:
    """KV Flash's pool: its size and bytes, and once running, where its chunks are."""
    line = (
        f"KV Flash: a pool of {pool['pool_tokens']} tokens ({pool['cache_rows']} rows) in each "
        f"of {pool['layers']} full-attention layers, {_mib(pool['pool_bytes'])} instead of "
        f"{_mib(pool['full_cache_bytes'])}; ranking {pool['policy']}"
    )
    if "page_outs" in pool:
        line += (
            f"; {pool['resident_chunks']} chunks resident, {pool['paged_chunks']} in host RAM "
            f"({_mib(pool['host_bytes'])}), {pool['page_outs']} page-outs, "
            f"{pool['page_ins']} page-ins"
        )
    return line


def experts_table(report: dict, path: str) -> Table:
    table = Table(
        title=f"expert profile {path}: {report['tokens']:,} tokens a layer; the top 10 % of "
        f"experts took {100 * report['skew']:.1f} % of the choices"
    )
    for col in ("layer", "tokens", "top 10 % share", "most chosen (expert: share)"):
        table.add_column(col)
    for row in report["layers"]:
        best = ", ".join(f"{e}: {100 * share:.1f}%" for e, share in row["top"])
        table.add_row(
            str(row["layer"]), f"{row['tokens']:,}", f"{100 * row['top10pct_share']:.1f} %", best
        )
    return table


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def build_plan(plan) -> str:
    kernels = (
        f"\n  kernels: lucepy's ({plan.kernels.patch.name} on the pinned source)"
        if plan.own
        else "\n  kernels: ggml's"
    )
    return (
        f"[bold]{plan.backend}[/] → {plan.prefix}\n  cmake {' '.join(plan.cmake_args)}\n"
        f"  targets: {' '.join(plan.targets)}{kernels}"
    )


def builds_table(builds: list, kernels: list, root) -> Table:
    table = Table(title=f"ggml builds in {root}")
    table.add_column("backend")
    table.add_column("kernels")
    table.add_column("directory")
    for (backend, path), which in zip(builds, kernels, strict=True):
        table.add_row(backend, _dash(which), str(path))
    return table


def status(message: str):
    """A spinner on stderr while long work runs."""
    return err_console.status(message)


# --- serve --tui and top: a live view of /lucepy/status ---


def _dash(value, fmt: str = "{}") -> str:
    return "–" if value is None else fmt.format(value)


def _server_stats(s: dict) -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="dim")
    table.add_column()
    last = s.get("last") or {}
    timings = last.get("timings") or {}
    req, queue, tokens = s["requests"], s["queue"], s["tokens"]
    cache = s.get("cache") or {}
    table.add_row("tokens/s", f"{s['tokens_per_s']:.1f} (last 5 s)")
    table.add_row("last request", _dash(timings.get("decode_tok_s"), "{:.1f} tok/s decode"))
    table.add_row("queue", f"{queue['waiting']} waiting, {queue['active']} running")
    batch = s.get("batch")
    if batch:
        per_step = batch["decoded"] / batch["decode"] if batch["decode"] else 0.0
        table.add_row(
            "batch",
            f"{batch['active']} of {batch['parallel']} sequences · {per_step:.1f} decoded a step",
        )
    table.add_row(
        "requests",
        f"{req['total']} total · {req['completed']} done · {req['cancelled']} cancelled · "
        f"{req['failed']} failed · {req['rejected']} rejected",
    )
    table.add_row("tokens", f"{tokens['prompt']:,} prompt · {tokens['completion']:,} generated")
    table.add_row("cache hits", f"{_dash(cache.get('hits'))} / misses {_dash(cache.get('misses'))}")
    accept = s.get("accept") or {}
    table.add_row("draft τ", _dash(accept.get("tau"), "{:.2f} tokens per verify"))
    return table


def status_view(s: dict, source: str = ""):
    """One frame of `lucepy top` / `serve --tui` from a /lucepy/status dict."""
    from rich.console import Group
    from rich.text import Text

    state = s.get("state", "?")
    color = "green" if state == "ready" else "red"
    head = Text.assemble(
        (s.get("model", "?"), "bold"),
        f"  {source}  " if source else "  ",
        (state, color),
        f"  context {s.get('n_ctx', '?')}  up {s.get('uptime_s', 0):.0f} s",
    )
    parts = [head, placement_table(s["placement"])]
    if s.get("kv_pool"):
        parts.append(Text(pool_line(s["kv_pool"]), style="dim"))
    return Group(*parts, _server_stats(s))


def unreachable_view(message: str, source: str):
    from rich.text import Text

    return Text.assemble((source, "bold"), "  ", ("unreachable", "red"), f": {message}")


def note(message: str) -> None:
    """A line for the user on stderr (stdout stays for data)."""
    err_console.print(message, highlight=False, soft_wrap=True)


def watch(frame, interval: float = 1.0) -> None:
    """Redraw ``frame()`` every ``interval`` seconds until Ctrl-C (KeyboardInterrupt)."""
    import time

    from rich.live import Live

    with Live(frame(), console=console, refresh_per_second=4, transient=False) as live:
        while True:
            time.sleep(interval)
            live.update(frame())


def models_table(rows: list[dict], source: str | None) -> Table:
    """`lucepy models`: rows are ModelEntry dicts plus `path`, `default`."""
    table = Table(title=f"models ({source or 'built-in only; no models.yaml found'})")
    for col in ("name", "file", "placement", "context", "draft", "status"):
        table.add_column(col)
    for r in rows:
        if r["path"]:
            state = "[green]ready[/]"
        else:
            state = "[yellow]made on first use[/]" if r["builtin"] == "tiny" else "[red]missing[/]"
        table.add_row(
            f"{r['name']} [dim](default)[/]" if r["default"] else r["name"],
            r["path"] or r["file"] or f"built-in {r['builtin']}",
            ",".join(r["placement"]) or "–",
            _dash(r["context"]),
            r["draft"] or "–",
            state,
        )
    return table


def show(renderable) -> None:
    console.print(renderable)


def print_json(text: str) -> None:
    sys.stdout.write(text + "\n")

"""All rich rendering lives here, behind one Console."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

console = Console()
err_console = Console(stderr=True)


def error(message: str) -> None:
    err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)


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


def show(renderable) -> None:
    console.print(renderable)


def print_json(text: str) -> None:
    sys.stdout.write(text + "\n")

"""unit tier: what the rich views show, captured from a recording Console."""

from __future__ import annotations

from rich.console import Console

from lucepy import tui

SHARDS = [
    {
        "device": "cuda:0",
        "backend": "cuda",
        "layers": [0, 32],
        "weight_bytes": 12 * 2**30,
        "state_bytes": 2 * 2**30,
        "process": "local",
    },
    {
        "device": "hip:0",
        "backend": "hip",
        "layers": [32, 64],
        "weight_bytes": 12 * 2**30,
        "state_bytes": 2 * 2**30,
        "process": "worker",
    },
]

STATUS = {
    "model": "qwen3.6-27b",
    "state": "ready",
    "n_ctx": 32768,
    "uptime_s": 61.0,
    "placement": SHARDS,
    "tokens_per_s": 42.5,
    "queue": {"waiting": 2, "active": 1},
    "requests": {"total": 9, "completed": 5, "cancelled": 1, "failed": 0, "rejected": 0},
    "tokens": {"prompt": 1234, "completion": 567},
    "last": {"timings": {"decode_tok_s": 40.25}},
    "cache": {"hits": None, "misses": None},
}


def render(renderable) -> str:
    console = Console(record=True, width=160, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_placement_table_shows_each_shard():
    text = render(tui.placement_table(SHARDS))
    for expected in ("cuda:0", "hip:0", "0–31", "32–63", "12,288.0 MiB", "worker", "█"):
        assert expected in text


def test_status_view_shows_placement_rate_queue_and_cache():
    text = render(tui.status_view(STATUS, "http://127.0.0.1:8080"))
    assert "qwen3.6-27b" in text and "ready" in text and "http://127.0.0.1:8080" in text
    assert "cuda:0" in text and "32–63" in text
    assert "42.5" in text and "40.2 tok/s decode" in text
    assert "2 waiting, 1 running" in text
    assert "9 total" in text and "1 cancelled" in text
    assert "cache hits" in text and "–" in text


def test_models_table_marks_the_default_and_missing_files():
    rows = [
        {"name": "lucepy-tiny", "file": None, "builtin": "tiny", "placement": ["cpu"],
         "context": None, "draft": None, "path": None, "default": True},
        {"name": "qwen3.6-27b", "file": "~/m/*.gguf", "builtin": None,
         "placement": ["cuda:0", "cuda:1"], "context": 32768, "draft": None, "path": None,
         "default": False},
    ]  # fmt: skip
    text = render(tui.models_table(rows, "./models.yaml"))
    assert "lucepy-tiny (default)" in text and "made on first use" in text
    assert "cuda:0,cuda:1" in text and "32768" in text and "missing" in text


def test_status_view_shows_the_batch_of_a_parallel_server():
    batch = {"parallel": 8, "active": 3, "prefill": 4, "decode": 10, "decoded": 25}
    text = render(tui.status_view({**STATUS, "batch": batch}))
    assert "3 of 8 sequences" in text and "2.5 decoded a step" in text
    assert "sequences" not in render(tui.status_view(STATUS))  # one at a time: no batch line

"""e2e tier: the CLI as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine


def lucepy(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lucepy", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        check=check,
    )


def test_generate_json_matches_the_engine(tiny_model):
    path = tiny_model("odd", "q8_0")
    out = json.loads(
        lucepy(
            "generate",
            path,
            "--prompt-tokens",
            "5,6,7,8,9",
            "--max-tokens",
            "12",
            "--chunk",
            "2",
            "--json",
            "--threads",
            "2",
        ).stdout
    )
    assert set(out) == {"prompt_tokens", "tokens", "text", "timings", "accept", "cache"}
    assert out["accept"] is None  # no draft
    assert out["cache"] is None or out["cache"]["hit"] == "none"  # no prefix cache asked for
    assert set(out["timings"]) == {"prefill_ms", "decode_ms", "prefill_tok_s", "decode_tok_s"}
    assert out["prompt_tokens"] == [5, 6, 7, 8, 9]
    with Engine(path, RuntimeConfig(threads=2)) as engine:
        logits, tokens = engine.prefill(out["prompt_tokens"]), []
        for _ in range(12):
            tokens.append(int(np.argmax(logits)))
            logits = engine.decode(tokens[-1])
        assert out["tokens"] == tokens
        assert out["text"] == engine.tokenizer.decode(tokens)


def test_generate_from_text_prompt(tiny_model):
    out = json.loads(
        lucepy(
            "generate",
            tiny_model(),
            "--prompt",
            "Hello world, this is",
            "--max-tokens",
            "6",
            "--json",
        ).stdout
    )
    assert len(out["tokens"]) == 6 and out["prompt_tokens"]
    assert out["timings"]["decode_tok_s"] > 0


def test_generate_needs_exactly_one_prompt(tiny_model):
    for args in ([], ["--prompt", "a", "--prompt-tokens", "1"]):
        run = lucepy("generate", tiny_model(), *args, check=False)
        assert run.returncode == 1 and "exactly one of --prompt" in run.stderr


def test_prompt_longer_than_context_is_refused(tiny_model):
    run = lucepy(
        "generate",
        tiny_model(),
        "--prompt-tokens",
        ",".join(["3"] * 40),
        "--max-ctx",
        "16",
        check=False,
    )
    assert run.returncode == 1
    assert "exceed the context of 16" in run.stderr and "Traceback" not in run.stderr


def test_token_ids_outside_the_vocabulary_are_refused(tiny_model):
    run = lucepy("generate", tiny_model(), "--prompt-tokens", "1,99999", check=False)
    assert run.returncode == 1 and "token id 99999 is outside the vocabulary" in run.stderr


def test_generate_restores_the_prompt_from_the_disk_cache(tiny_model, tmp_path):
    args = ["generate", tiny_model(), "--prompt-tokens", "5,6,7,8,9", "--max-tokens", "8"]
    cache = ["--kv-cache-dir", tmp_path / "kv", "--disk-prefix-cache", "full", "--json"]
    first, second = (json.loads(lucepy(*args, *cache).stdout) for _ in range(2))
    assert first["cache"] == {"hit": "none", "restored_tokens": 0, "prefilled_tokens": 5}
    assert second["cache"] == {"hit": "disk", "restored_tokens": 5, "prefilled_tokens": 0}
    assert second["tokens"] == first["tokens"]


def test_a_bad_disk_cache_policy_is_one_line(tiny_model):
    run = lucepy("generate", tiny_model(), "--prompt", "a", "--disk-prefix-cache", "x", check=False)
    assert run.returncode == 1 and "--disk-prefix-cache takes off, full" in run.stderr
    assert "Traceback" not in run.stderr

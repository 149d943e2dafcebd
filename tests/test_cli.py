"""e2e tier: the CLI as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from lucepy import catalog
from lucepy.decode.ar import generate
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine


def lucepy(*args: str, check: bool = True, home=None) -> subprocess.CompletedProcess:
    """``python -m lucepy ARGS``; with ``home``, run there as a user with no models.yaml and an
    empty cache."""
    env, cwd = None, None
    if home is not None:
        env = {**os.environ, "HOME": str(home), "LUCEPY_CACHE_DIR": str(home / "cache")}
        env.pop("LUCEPY_MODELS", None)
        cwd = home
    return subprocess.run(
        [sys.executable, "-m", "lucepy", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        check=check,
        env=env,
        cwd=cwd,
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
    assert set(out) == {"prompt_tokens", "tokens", "text", "timings", "accept", "cache", "kv_pool"}
    assert out["kv_pool"] is None  # no --kv-pool
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


def test_generate_with_no_model_answers_with_smollm2(tmp_path):
    prompt = "The capital of France is"
    args = ["generate", "--prompt", prompt, "--max-tokens", "6", "--threads", "2", "--json"]
    out = json.loads(lucepy(*args, home=tmp_path).stdout)
    assert out["text"].startswith(" Paris")
    # The shipped draft is loaded; whether it drafts follows this CPU's measured step costs
    # (verify_len.py), which sit near the line on a 2-core machine: one of a suite's runs drafted
    # (at one token a step). Either way the tokens are plain decoding's (below).
    assert out["accept"] is None or set(out["accept"]) >= {"accepted", "drafted"}
    with Engine(catalog.smollm2_file(), RuntimeConfig(threads=2)) as engine:
        assert out["prompt_tokens"] == engine.tokenizer.encode(prompt)  # no chat template
        assert out["tokens"] == generate(engine, out["prompt_tokens"], 6).tokens
    # nothing downloaded; written: the step costs, measured once
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["step-costs"]


def test_generate_chat_sends_the_prompt_through_the_chat_template(tmp_path):
    """--chat/--system: the model's own template, as the server renders a chat request; the raw
    question gets nothing from SmolLM2 (its first token ends the text)."""
    args = ["generate", "--prompt", "What is the capital of France?", "--max-tokens", "24"]
    chat = json.loads(lucepy(*args, "--system", "You are a helpful assistant.", "--json").stdout)
    raw = json.loads(lucepy(*args, "--json").stdout)
    assert chat["text"] == "The capital of France is Paris."
    assert len(chat["prompt_tokens"]) > len(raw["prompt_tokens"]) and raw["text"] == ""


def test_generate_takes_a_models_yaml_name_with_its_defaults(tiny_model, tmp_path):
    (tmp_path / "models.yaml").write_text(
        f"models:\n  mine:\n    file: {tiny_model()}\n    context: 16\n"
    )
    args = ["--prompt-tokens", "5,6,7,8,9", "--max-tokens", "6", "--json"]
    by_name = json.loads(lucepy("generate", "mine", *args, home=tmp_path).stdout)
    by_path = json.loads(lucepy("generate", tiny_model(), *args, home=tmp_path).stdout)
    assert by_name["tokens"] == by_path["tokens"]
    too_long = ",".join(["3"] * 20)
    run = lucepy("generate", "mine", "--prompt-tokens", too_long, check=False, home=tmp_path)
    assert run.returncode == 1 and "exceed the context of 16" in run.stderr  # the entry's context


def test_generate_lucepy_tiny_decodes_with_its_draft(tmp_path):
    args = ["generate", "lucepy-tiny", "--prompt-tokens", "5,6,7", "--max-tokens", "8", "--json"]
    # a fixed block: with auto lengths, whether a random draft drafts depends on measured times
    out = json.loads(lucepy(*args, "--draft-block", "8", home=tmp_path).stdout)
    assert out["accept"]["steps"] > 0  # the built-in draft, as `serve lucepy-tiny` uses it
    with Engine(tmp_path / "cache" / "models" / catalog.TINY_FILE, RuntimeConfig()) as engine:
        assert out["tokens"] == generate(engine, [5, 6, 7], 8).tokens  # speculative == greedy

"""Verify lengths from measured costs (decode/verify_len.py): the choice, its bookkeeping, and
speculation with chosen lengths == greedy."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import THREADS

from lucepy.decode.ar import generate
from lucepy.decode.verify_len import StepCosts, VerifyLength
from lucepy.engine import Engine
from lucepy.errors import ConfigError
from lucepy.runtime.config import RuntimeConfig
from lucepy.testing.tiny_draft import write_agreeing_pair

PROMPT = list(range(3, 40))


def costs(verify: list[float], draft: float = 0.0) -> StepCosts:
    """Hand-made costs whose plain decode costs what the 1-token verify does."""
    return StepCosts((0.0, 0.0) + (draft,) * (len(verify) - 1), (0.0, *verify), verify[0])


def test_the_choice_maximises_expected_tokens_per_second():
    flat = costs([1.0] * 8)  # every length costs the same: the longest wins
    assert VerifyLength(flat).choose(8) == 8
    assert VerifyLength(flat).choose(3) == 3  # bounded by the room left
    steep = costs([1.0 + 0.7 * k for k in range(8)])  # each draft costs 0.7 decodes
    lengths = VerifyLength(steep, prior=(0.6, 2.0))
    e = lengths.expected()
    assert e[0] == 1.0 and np.allclose(e[1:], 1 + np.cumsum(0.6 ** np.arange(1, 8)))
    rate = e / np.array([steep.step(k) for k in range(1, 9)])
    assert lengths.choose(8) == int(np.argmax(rate)) + 1 == 1  # 1.6 / 1.7 < 1 / 1
    assert not lengths.drafts()  # even the prior cannot pay: generation decodes plainly
    assert VerifyLength(steep, prior=(0.95, 2.0)).drafts()


def test_drafting_competes_with_a_plain_decode():
    """A 1-token verify also copies the features the draft reads: where a plain decode is
    cheaper, drafting must beat the decode, not that verify."""
    pays_over_verify = costs([1.0 + 0.3 * k for k in range(8)])  # 1.6 / 1.3 > 1 / 1
    assert VerifyLength(pays_over_verify, prior=(0.6, 2.0)).drafts()
    cheap = StepCosts(pays_over_verify.draft, pays_over_verify.verify, decode=0.7)
    lengths = VerifyLength(cheap, prior=(0.6, 2.0))
    best = max(lengths.expected()[1:] / [cheap.step(k) for k in range(2, 9)])
    assert best < 1 / 0.7 and not lengths.drafts()
    assert VerifyLength(cheap, prior=(0.95, 2.0)).drafts()
    assert StepCosts.from_dict(cheap.to_dict()) == cheap
    old = {"draft": list(cheap.draft), "verify": list(cheap.verify)}  # cached before decode
    with pytest.raises(KeyError):  # the engine measures such costs anew
        StepCosts.from_dict(old)


def test_a_step_informs_only_the_drafts_it_offered():
    lengths = VerifyLength(costs([1.0] * 8), prior=(0.5, 1.0))
    before = lengths.offered.copy()
    lengths.record(4, 1)  # drafts 1..3 offered: 1 taken, 2 refused, 3 never judged
    decayed = 0.98 * before + 0.02 * lengths.prior_offered
    assert np.allclose(lengths.offered - decayed, [0, 1, 1, 0, 0, 0, 0, 0])
    lengths.record(3, 2)  # all (two) drafts taken: nothing is known of a third
    rates = lengths.accepted / lengths.offered
    assert rates[1] > 0.5 and rates[2] > 0.5 and rates[3] == pytest.approx(0.5)
    lengths = VerifyLength(costs([1.0 + 0.3 * k for k in range(8)]), prior=(0.5, 1.0))
    assert lengths.choose(8) > 1
    for _ in range(200):  # refused every time: the choice falls to plain decoding
        lengths.record(lengths.choose(8), 0)
    assert lengths.choose(8) == 1 and lengths.drafts()  # the prior would try again


@pytest.mark.parametrize("prior", [(0.9, 2.0), (0.6, 2.0)])
def test_speculation_with_chosen_lengths_equals_greedy(tmp_path, monkeypatch, prior):
    monkeypatch.setenv("LUCEPY_CACHE_DIR", str(tmp_path / "cache"))
    target, draft = write_agreeing_pair(tmp_path)
    cfg = RuntimeConfig(threads=THREADS, max_ctx=256, draft=str(draft), verify_len="auto")
    with Engine(target, RuntimeConfig(threads=THREADS, max_ctx=256), tokenizer=False) as engine:
        plain = generate(engine, PROMPT, 60, stop_at_end=False).tokens
    with Engine(target, cfg, tokenizer=False) as engine:
        measured = engine.verify_lengths().costs  # measured on this engine, then cached
        assert all(c > 0 for c in measured.verify[1:]) and measured.block == 8
        # lengths that vary: each costs its draft and a tenth of a decode per row
        engine._lengths = VerifyLength(costs([1 + 0.1 * k for k in range(8)], 0.2), prior)
        chosen = []
        choose = engine._lengths.choose
        engine._lengths.choose = lambda limit: chosen.append(choose(limit)) or chosen[-1]
        gen = generate(engine, PROMPT, 60, stop_at_end=False)
    assert gen.tokens == plain
    assert len(set(chosen)) > 1, chosen
    steps = len(chosen)  # each choice one step (whether to draft at all asks no choice)
    assert gen.accept.steps == steps and sum(gen.accept.histogram) == steps
    cached = list((tmp_path / "cache" / "step-costs").iterdir())
    assert len(cached) == 1 and StepCosts.from_dict(json.loads(cached[0].read_text())) == measured


def test_a_context_too_small_to_time_lengths_keeps_the_block(tmp_path, monkeypatch):
    monkeypatch.setenv("LUCEPY_CACHE_DIR", str(tmp_path / "cache"))
    target, draft = write_agreeing_pair(tmp_path)
    cfg = RuntimeConfig(threads=THREADS, max_ctx=96, draft=str(draft), verify_len="auto")
    with Engine(target, cfg, tokenizer=False) as engine:
        assert engine.verify_lengths() is None  # 64 + 4 x 8 decodes + 4 x 8 + 8: no room
        gen = generate(engine, PROMPT, 24, stop_at_end=False)
    assert gen.accept.steps > 0 and gen.accept.drafted == 7 * gen.accept.steps
    assert not (tmp_path / "cache").exists()


def test_measured_costs_are_kept_per_ggml_build(tmp_path, monkeypatch):
    """The cached costs belong to the ggml build that measured them: another build in the same
    directory (a rebuild with other kernels: its files' sizes and times change) or lucepy's CUDA
    or CPU kernels forced on or off, or their layouts or FP8 product switched, measure anew; the
    same build reads the cache."""
    from lucepy.ggml import load
    from lucepy.ggml.lib import KERNEL_SWITCHES, build_identity

    monkeypatch.setenv("LUCEPY_CACHE_DIR", str(tmp_path / "cache"))
    target, draft = write_agreeing_pair(tmp_path)
    cfg = RuntimeConfig(threads=THREADS, max_ctx=256, draft=str(draft), verify_len="auto")
    cached = tmp_path / "cache" / "step-costs"

    def measure_once() -> int:
        with Engine(target, cfg, tokenizer=False) as engine:
            engine.verify_lengths()
        return len(list(cached.iterdir()))

    assert measure_once() == 1
    assert measure_once() == 1  # the same build: read back
    (only,) = cached.iterdir()
    only.write_text('{"draft": [0.0]}\n')  # cut short, or from before costs had a decode
    assert measure_once() == 1 and StepCosts.from_dict(json.loads(only.read_text())).decode > 0
    monkeypatch.setenv("LUCEPY_CUDA_KERNELS", "0")
    assert measure_once() == 2
    monkeypatch.setenv("LUCEPY_CPU_KERNELS", "0")
    assert measure_once() == 3
    monkeypatch.setenv("LUCEPY_CUDA_F8", "0")
    assert measure_once() == 4
    lib = load()
    before = build_identity(lib)
    n = len(KERNEL_SWITCHES)
    monkeypatch.setattr(
        "lucepy.engine.build_identity", lambda lib: [*before[:-n], ["rebuilt"], *before[-n:]]
    )
    assert measure_once() == 5


def test_a_rebuild_in_place_is_another_build(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from lucepy.ggml.lib import KERNEL_SWITCHES, build_identity

    for name in KERNEL_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    lib = tmp_path / "libggml-cuda.so"
    lib.write_bytes(b"one build")
    (tmp_path / "libllama.so").write_bytes(b"not ggml's")
    built = SimpleNamespace(directory=tmp_path)
    first = build_identity(built)
    assert first[0] == ["libggml-cuda.so", 9, lib.stat().st_mtime_ns]
    n = len(KERNEL_SWITCHES)
    assert first[-n:] == [None] * n
    # lucepy's CPU kernel module is the other file (tests/test_cpu_kernel.py: pip built it)
    assert [f[0].startswith("_cpu.") for f in first[1:-n]] == [True]
    lib.write_bytes(b"another build")
    assert build_identity(built) != first


def test_a_bad_verify_len_is_refused():
    with pytest.raises(ConfigError, match="verify_len must be 'fixed' or 'auto'"):
        RuntimeConfig(verify_len="sometimes")

"""lucepy's Q4_1 and Q5_1 CPU kernels (vendor/ggml/cpu/lucepy-cpu.c): bit for bit ggml's mul_mat,
in every variant this CPU runs, and what the default model's and its draft's graphs give them."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import numpy as np
import pytest
from conftest import THREADS
from test_llama import SMOLLM2, prompt_logits

from lucepy.catalog import smollm2_draft_file, smollm2_file
from lucepy.decode.ar import generate
from lucepy.engine import Engine
from lucepy.ggml import cpu, load
from lucepy.ggml.owners import Buffer, Context
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.devices import open_backend

PROMPTS = Path(__file__).parents[1] / "tools" / "dflash_prompts.json"


def _avx2() -> bool:
    if platform.machine() != "x86_64":
        return False
    with open("/proc/cpuinfo") as f:
        flags = f.read()
    return all(f" {flag}" in flags for flag in ("avx2", "fma", "f16c"))


pytestmark = pytest.mark.skipif(not _avx2(), reason="the kernel needs x86-64 with AVX2")


@pytest.fixture(scope="module")
def backend():
    lib = load()
    with open_backend(lib, "cpu", THREADS) as b:
        yield lib, b


def test_it_is_built_for_this_ggml_and_cpu(backend):
    """pip built it (setup.py), for the pinned tensor layout; this CPU runs at least the AVX2
    variant of each type, and AVX-VNNI's first where it has it; both pass the check."""
    lib, b = backend
    assert cpu._layout_mismatch() is None
    assert set(cpu.kernels(lib, b)) == {cpu.Q4_1, cpu.Q5_1}, cpu.why_not()
    with open("/proc/cpuinfo") as f:
        vnni = " avx_vnni" in f.read()
    for gtype in cpu.KINDS:
        names = [k.variant for k in cpu.variants(gtype)]
        assert names[-1] == "avx2" and ("avx2+avxvnni" in names) == vnni


@pytest.mark.parametrize("gtype", [cpu.Q4_1, cpu.Q5_1], ids=["q4_1", "q5_1"])
@pytest.mark.parametrize("K", [32, 256, 1536])
@pytest.mark.parametrize("rows,cols", [(1, 3), (2, 4), (37, 11), (130, 5), (5, 33), (64, 16)])
def test_every_variant_gives_ggml_bits(backend, gtype, rows, cols, K):
    """Every tile shape (odd rows, 1-3 columns left over) and block count, against ggml's
    mul_mat on the same backend, every value's bits."""
    lib, b = backend
    for k in cpu.variants(gtype):
        assert cpu.check(lib, b, k, gtype, rows, cols, K) is None, k.variant


def test_few_columns_and_other_types_stay_ggml(backend):
    """One or two columns, Q8_0 weights and f32 weights are left to ggml; three columns are
    taken, and two products of the same x share one Q8_1 copy."""
    lib, b = backend
    kinds = cpu.kernels(lib, b)
    assert kinds, cpu.why_not()
    ctx = Context(lib, 16, graph_nodes=32)
    try:
        q41 = lib.ggml_new_tensor_2d(ctx.ptr, cpu.Q4_1, 64, 8)
        q41b = lib.ggml_new_tensor_2d(ctx.ptr, cpu.Q4_1, 64, 8)
        q80 = lib.ggml_new_tensor_2d(ctx.ptr, lib.GGML_TYPE_Q8_0, 64, 8)
        f32 = lib.ggml_new_tensor_2d(ctx.ptr, cpu.F32, 64, 8)
        with Buffer(lib, ctx, b, "weights"):
            xs = {n: lib.ggml_new_tensor_2d(ctx.ptr, cpu.F32, 64, n) for n in (1, 2, 3)}
            gf = lib.ggml_new_graph_custom(ctx.ptr, 32, False)
            products = [lib.ggml_mul_mat(ctx.ptr, q41, xs[n]) for n in (1, 2, 3)]
            products += [lib.ggml_mul_mat(ctx.ptr, w, xs[3]) for w in (q41b, q80, f32)]
            for p in products:
                lib.ggml_build_forward_expand(gf, p)
            before = lib.ggml_graph_n_nodes(gf)
            assert cpu.take_products(lib, ctx.ptr, gf, kinds) == 2
            assert lib.ggml_graph_n_nodes(gf) == before + 1  # one Q8_1 copy of xs[3]
            ops = [int(p.op) for p in products]
            assert ops == [
                cpu.MUL_MAT,
                cpu.MUL_MAT,
                cpu.CUSTOM,
                cpu.CUSTOM,
                cpu.MUL_MAT,
                cpu.MUL_MAT,
            ]
            assert products[2].src[1] == products[3].src[1]
    finally:
        ctx.close()


def test_the_default_model_gives_the_same_logits_with_it(monkeypatch):
    """SmolLM2's prompt logits at every position: the products of its 12-token prefill go to
    the kernel, and every logit has the bits it has on ggml's kernels."""
    tokens = list(range(100, 112))
    monkeypatch.setenv(cpu.ENV, "0")
    theirs = prompt_logits(SMOLLM2, tokens)
    monkeypatch.setenv(cpu.ENV, "1")
    taken = cpu.taken_count(cpu.Q4_1)
    ours = prompt_logits(SMOLLM2, tokens)
    assert cpu.taken_count(cpu.Q4_1) - taken == 30 * 7  # every Q4_1 product of its 30 layers
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def test_the_draft_proposes_the_same_tokens_with_it(monkeypatch):
    """The shipped draft (Q5_1) proposes 16 tokens a step: its products and the target's verify
    go to the kernels, and a speculative generation commits the same tokens with the same
    acceptance as on ggml's kernels."""
    prompt = json.loads(PROMPTS.read_text())["heldout"][0]
    cfg = RuntimeConfig(threads=THREADS, max_ctx=512, draft=str(smollm2_draft_file()))

    def speculate() -> tuple[list[int], int]:
        with Engine(smollm2_file(), cfg, tokenizer=False) as engine:
            gen = generate(engine, prompt, 32, stop_at_end=False)
        return gen.tokens, gen.accept.accepted

    monkeypatch.setenv(cpu.ENV, "0")
    theirs = speculate()
    monkeypatch.setenv(cpu.ENV, "1")
    taken = {gtype: cpu.taken_count(gtype) for gtype in cpu.KINDS}
    assert speculate() == theirs
    assert all(cpu.taken_count(gtype) > taken[gtype] for gtype in cpu.KINDS)

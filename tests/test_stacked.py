"""Stacked products (Architecture.stacked): weights of products of one input loaded as one matrix
(llama's Q, K and V; qwen35's four delta-net input products and attention's Q, K and V;
laguna's Q, K, V and output gate), one product, each part a view of its rows. On the CPU the
results are the separate products' to the bit, and a stack whose parts a CPU would repack
otherwise than the whole is kept apart."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from conftest import THREADS

import lucepy.runtime.engine as engine_module
from lucepy.catalog import smollm2_file
from lucepy.ggml import ffi, load
from lucepy.gguf import GGUFFile
from lucepy.runtime import tensors
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
PROMPT = list(range(40, 75))


PLAIN_OPTIONS = engine_module.model_options


def engine_stacking(path, stack: bool, monkeypatch) -> Engine:
    """An engine (chunks of 16) whose products are stacked, or not, whatever its device."""
    monkeypatch.setattr(
        engine_module,
        "model_options",
        lambda cfg: dataclasses.replace(PLAIN_OPTIONS(cfg), stack_matmuls=stack),
    )
    cfg = RuntimeConfig(threads=THREADS, max_ctx=256, chunk=16)
    return Engine(path, cfg, tokenizer=False)


def run(path, stack: bool, monkeypatch) -> tuple[list[str], np.ndarray, list[np.ndarray]]:
    """The stacked keys, prompt logits (in chunks of 16) and 4 decode steps' logits."""
    with engine_stacking(path, stack, monkeypatch) as engine:
        keys = [k for k in engine.shards[0].w if k.endswith(".stacked")]
        prompt = engine.prefill(PROMPT, all_logits=True).copy()
        steps = [engine.decode(7 + i).copy() for i in range(4)]
    return keys, prompt, steps


@pytest.mark.parametrize(
    "path",
    [
        smollm2_file(),
        FIXTURES / "qwen35-q8_0.gguf",
        FIXTURES / "qwen35-q4_k_m.gguf",
        FIXTURES / "llama-untied-q8_0.gguf",
        FIXTURES / "laguna-xs-q8_0.gguf",
        FIXTURES / "laguna-m-q8_0.gguf",
    ],
    ids=lambda p: Path(p).stem,
)
def test_stacked_products_equal_separate_ones(path, monkeypatch):
    keys, prompt, steps = run(path, True, monkeypatch)
    none, prompt0, steps0 = run(path, False, monkeypatch)
    assert keys and not none, "nothing was stacked"
    np.testing.assert_array_equal(prompt, prompt0)
    for a, b in zip(steps, steps0, strict=True):
        np.testing.assert_array_equal(a, b)


def test_products_of_mixed_types_stack_in_the_largest_groups_they_allow(tiny_model, monkeypatch):
    """Where the DeltaNet's qkv and half the attention layers' V differ in type from the rest
    (as llama-quantize's Q4_K_M makes them), z, beta and alpha are one product and so are Q and
    K, V's and qkv's apart; the logits are the separate products' to the bit."""
    path = tiny_model("wide", "q4_k_mix")
    keys, prompt, steps = run(path, True, monkeypatch)
    none, prompt0, steps0 = run(path, False, monkeypatch)
    with GGUFFile(path) as f:
        n_layer = int(f.get("qwen35.block_count"))
        attention = {il for il in range(n_layer) if f"blk.{il}.attn_q.weight" in f.tensors}
    stacks = {il: "attn_qk" if il in attention else "ssm_zba" for il in range(n_layer)}
    want = [f"blk.{il}.{key}.stacked" for il, key in stacks.items()]
    assert sorted(keys) == sorted(want) and not none
    np.testing.assert_array_equal(prompt, prompt0)
    for a, b in zip(steps, steps0, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_stack_whose_parts_repack_otherwise_is_kept_apart(monkeypatch):
    """Parts that would land in another buffer type than their stack (a CPU repacks by row
    count) are loaded apart, under their own names."""
    path = FIXTURES / "qwen35-q8_0.gguf"
    with GGUFFile(path) as f:
        qkv = ("blk.0.attn_qkv.weight", "blk.0.attn_gate.weight")
        pair = ("blk.0.ssm_beta.weight", "blk.0.ssm_alpha.weight")
        matmul = {"blk.0.ssm_qkvz.stacked": qkv, "blk.0.ssm_ba.stacked": pair}

        def placement(lib, backend, weights):  # the stack of the pair repacks, its parts not
            return {k: "repacked" for k in weights if k == "blk.0.ssm_ba.stacked"}

        monkeypatch.setattr(tensors, "matmul_placement", placement)
        out = tensors._stackable(load(), None, f, matmul)
    assert out == {"blk.0.ssm_qkvz.stacked": qkv, pair[0]: pair[0], pair[1]: pair[1]}


def test_products_stack_by_default_where_a_device_is_not_a_cpu(monkeypatch):
    from lucepy.runtime.config import RuntimeConfig
    from lucepy.runtime.engine import model_options

    def stacked(device: str) -> bool:
        return model_options(RuntimeConfig(device=device)).stack_matmuls

    monkeypatch.delenv("LUCEPY_STACK_MATMULS", raising=False)
    assert not stacked("cpu") and not stacked("cpu,cpu@worker")
    assert stacked("cuda:0") and stacked("cpu@worker,cuda:0")
    monkeypatch.setenv("LUCEPY_STACK_MATMULS", "0")
    assert not stacked("cuda:0")
    monkeypatch.setenv("LUCEPY_STACK_MATMULS", "1")
    assert stacked("cpu")


def test_a_gated_norm_stays_back_to_back_when_its_gate_is_a_stacks_part(monkeypatch):
    """qwen35's DeltaNet output norm and gate (RMS_NORM, MUL by its weight, SiLU of z, MUL) stay
    consecutive graph nodes (views apart) in a step of several tokens, where z is a copy out of
    the stacked product: lucepy's CUDA kernels compute the four as one kernel only so."""
    with engine_stacking(FIXTURES / "qwen35-f32.gguf", True, monkeypatch) as engine:
        assert any(k.endswith("ssm_in.stacked") for k in engine.shard.w)
        engine.prefill(PROMPT[:16])
        lib = engine.lib
        views = {lib.GGML_OP_VIEW, lib.GGML_OP_RESHAPE, lib.GGML_OP_PERMUTE,
                 lib.GGML_OP_TRANSPOSE, lib.GGML_OP_NONE}  # fmt: skip
        found = 0
        for g in engine.shard.graphs.values():
            nodes = [lib.ggml_graph_node(g.gf, i) for i in range(lib.ggml_graph_n_nodes(g.gf))]
            ops = [n for n in nodes if n.op not in views]
            for i, n in enumerate(ops[:-3]):
                w = n.src[1] if n.op == lib.GGML_OP_MUL else None
                name = ffi.string(lib.ggml_get_name(w)).decode() if w else ""
                if name.endswith("ssm_norm.weight") and n.src[0].op == lib.GGML_OP_RMS_NORM:
                    found += 1
                    assert ops[i - 1] == n.src[0], name  # the norm just before
                    assert [ops[i + 1].op, ops[i + 2].op] == [
                        lib.GGML_OP_UNARY,
                        lib.GGML_OP_MUL,
                    ], name
        assert found >= 3  # the fixture's DeltaNet layers, in the 16-token graph

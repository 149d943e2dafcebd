"""The real-size random GGUFs of ``lucepy.testing.big`` (what the GPU benchmarks run), written
with scaled-down shapes: llama.cpp loads them, stores their tensors in the types its quantize
would choose, and lucepy decodes them as llama.cpp does."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import THREADS
from gguf import GGMLQuantizationType as QType
from test_parity_sweep import BOUND

from lucepy.decode.ar import generate
from lucepy.gguf import GGUFFile
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine
from lucepy.testing.big import main
from lucepy.testing.big_laguna import laguna_layout, laguna_xs2
from lucepy.testing.big_layouts import (
    MoeSpec,
    gemma4_31b,
    gemma4_layout,
    qwen35_layout,
    qwen35moe_layout,
    qwen36_27b,
    qwen36_35b_a3b,
)

SMALL = {
    "qwen35": lambda: qwen35_layout(
        qwen36_27b(
            "q4_0", 4, n_vocab=1024, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, head_dim=64,
            rope_dim=16, rope_sections=None, ssm_state_size=32, ssm_group_count=2,
            ssm_time_step_rank=4, context_length=1024,
        )
    ),
    "qwen35moe": lambda: qwen35moe_layout(
        qwen36_35b_a3b(
            "q4_0", 4, n_vocab=1024, n_embd=256, n_head=4, n_head_kv=2, head_dim=64,
            rope_dim=16, rope_sections=None, ssm_state_size=32, ssm_group_count=2,
            ssm_time_step_rank=4, context_length=1024,
        )[0],
        MoeSpec(n_expert=16, n_expert_used=4, n_ff_exp=64, n_ff_shexp=96, zipf=0.3),
    ),
    "gemma4": lambda: gemma4_layout(
        gemma4_31b(
            "q4_0", 12, n_vocab=1024, n_embd=256, n_ff=512, n_head=4, n_head_kv=1,
            n_head_kv_swa=2, head_dim=128, head_dim_swa=64, window=8, context_length=1024,
        )
    ),
    "laguna": lambda: laguna_layout(
        laguna_xs2(
            "q4_0", 5, n_vocab=1024, n_embd=256, n_ff=512, heads_full=4, heads_swa=6,
            n_head_kv=2, head_dim=64, rope_dim=32, window=8, yarn_orig_ctx=256,
            context_length=1024,
        )[0],
        MoeSpec(n_expert=16, n_expert_used=4, n_ff_exp=64, n_ff_shexp=96, zipf=0.3),
    ),
}  # fmt: skip
PROMPT = list(range(40, 70))  # longer than gemma4's and laguna's windows


@pytest.mark.parametrize("arch", sorted(SMALL))
def test_big_writer_decodes_as_llama_cpp(arch, tmp_path, reference):
    from lucepy.testing.big import write_random

    layout = SMALL[arch]()
    path = write_random(tmp_path / f"{arch}.gguf", layout, threads=2)
    with GGUFFile(path) as f:
        types = {name: t.type for name, t in f.tensors.items()}
        assert f.metadata["general.architecture"] == arch
    assert types["blk.0.attn_norm.weight"] == QType.F32
    assert types["output_norm.weight"] == QType.F32
    if arch == "gemma4":  # tied: the embedding is the output, so it takes the output's Q6_K
        assert "output.weight" not in types and types["token_embd.weight"] == QType.Q6_K
        assert "blk.5.attn_v.weight" not in types and "blk.4.attn_v.weight" in types
    else:
        assert types["output.weight"] == QType.Q6_K and types["token_embd.weight"] == QType.Q4_0
    if arch in ("qwen35moe", "laguna"):  # routers stay f32, as llama.cpp's quantize leaves them
        assert types["blk.1.ffn_gate_inp.weight"] == QType.F32
        assert types["blk.1.ffn_down_exps.weight"] == QType.Q4_0
    if arch == "laguna":  # a dense first layer; the selection bias is f32, the gate a matmul
        assert "blk.0.ffn_down.weight" in types and "blk.0.ffn_gate_inp.weight" not in types
        assert types["blk.1.exp_probs_b.bias"] == QType.F32
        assert types["blk.1.attn_gate.weight"] == QType.Q4_0
    config = RuntimeConfig(threads=THREADS, max_ctx=256)
    ref = reference(path, len(PROMPT))
    with Engine(path, config, tokenizer=False) as engine:
        logits = engine.prefill(PROMPT, chunk=len(PROMPT), all_logits=True).copy()
        engine.reset()
        ours = generate(engine, PROMPT, 16, stop_at_end=False).tokens
    theirs = ref.prompt_logits(PROMPT)
    assert theirs.std(axis=-1).min() > 0.1
    diff = np.abs(logits - theirs).max(axis=-1)
    assert diff.max() <= BOUND, f"position {diff.argmax()}: {diff.max():.2e}"
    # a tied random model mostly repeats its input (the residual carries the token's embedding)
    assert ours == ref.greedy(PROMPT, 16)


def test_big_cli_refuses_a_model_without_an_attention_layer(tmp_path, capsys):
    assert main([str(tmp_path / "g.gguf"), "--arch", "gemma4", "--layers", "5"]) == 2
    assert "at least 6" in capsys.readouterr().err
    assert not (tmp_path / "g.gguf").exists()

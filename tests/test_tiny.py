"""Tiny qwen35 GGUFs load in llama.cpp and behave like a language model, if a random one."""

from __future__ import annotations

import itertools

import gguf
import numpy as np
import pytest

from lucepy.errors import ConfigError
from lucepy.testing.encoders import encode_q4_k, encode_q5_k, encode_q6_k
from lucepy.testing.tiny import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    Qwen35Spec,
    build_vocab,
    main,
    write_qwen35,
)

llama_cpp = pytest.importorskip("llama_cpp")

TEXT = "Hello world, this is a test."
SPECS = {
    "default": {},
    # odd layer count, interval 3 (one attention layer), n_embd not a power of two
    "odd": {"full_attention_interval": 3, "n_layer": 5, "n_embd": 96},
}
CASES = [(name, wtype) for name in SPECS for wtype in ("f32", "q8_0")]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    return {
        (name, wtype): write_qwen35(out / f"{name}-{wtype}.gguf", weight_type=wtype, **SPECS[name])
        for name, wtype in CASES
    }


@pytest.fixture(scope="module", params=CASES, ids=lambda case: "-".join(case))
def llm(request, files):
    model = llama_cpp.Llama(
        model_path=str(files[request.param]), n_ctx=256, logits_all=True, verbose=False
    )
    yield model
    model.close()


def test_tokenizer_round_trip(llm):
    tokens = llm.tokenize(TEXT.encode())
    assert llm.detokenize(tokens).decode() == TEXT
    assert len(tokens) < len(TEXT)  # merges applied, not just bytes


def test_chat_metadata(llm):
    assert llm.metadata["tokenizer.chat_template"] == CHAT_TEMPLATE
    assert llm.metadata["general.architecture"] == "qwen35"
    assert llm.token_eos() == llm.n_vocab() - 1  # <|im_end|>


def test_logits_not_degenerate(llm):
    llm.reset()
    llm.eval(llm.tokenize(TEXT.encode()))
    logits = np.asarray(llm.scores[: llm.n_tokens])
    assert np.isfinite(logits).all()
    assert (logits.std(axis=-1) > 0.1).all()
    assert len({int(i) for i in logits.argmax(axis=-1)}) > 1


def test_greedy_continuation_varies(llm):
    prompt = llm.tokenize(TEXT.encode())
    out = list(itertools.islice(llm.generate(prompt, temp=0.0, reset=True), 32))
    assert len(set(out)) > 1


def test_quantized_tensors_follow_f32(files):
    f32 = {t.name: t for t in gguf.GGUFReader(files["default", "f32"]).tensors}
    q8 = gguf.GGUFReader(files["default", "q8_0"])
    assert q8.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q8_0
    n_quantized = 0
    for t in q8.tensors:
        ref = np.asarray(f32[t.name].data)
        if t.tensor_type == gguf.GGMLQuantizationType.F32:
            np.testing.assert_array_equal(t.data, ref)
            continue
        n_quantized += 1
        got = gguf.quants.dequantize(t.data, t.tensor_type)
        # half a q8_0 step (max|x| / 127 per 32-block) plus the f16 rounding of that step
        tol = np.abs(ref).reshape(-1, 32).max(axis=1).repeat(32) / 127 * 0.6 + 1e-6
        assert (np.abs(got - ref).reshape(-1) <= tol).all(), t.name
    assert n_quantized > 0


def wide_model_in_llama_cpp(tmp_path, wtype: str, qtype) -> tuple:
    """A wide tiny model (rows of 256 values) in ``wtype``, its matmul weights of that ggml type,
    run by llama.cpp on TEXT: (its path, the tokens, their logits, which vary)."""
    path = write_qwen35(
        tmp_path / f"{wtype}.gguf", weight_type=wtype, n_embd=256, n_ff=512, ssm_state_size=64,
        ssm_time_step_rank=8,
    )  # fmt: skip
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ffn_down.weight"] == qtype and types["output.weight"] == qtype
    model = llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False)
    try:
        tokens = model.tokenize(TEXT.encode())
        model.eval(tokens)
        logits = np.asarray(model.scores[: model.n_tokens])
    finally:
        model.close()
    assert np.isfinite(logits).all() and (logits.std(axis=-1) > 0.1).all()
    return path, tokens, logits


def assert_cpu_logits_near(path, tokens, ref) -> None:
    """lucepy's logits of ``tokens`` on the CPU are ``ref`` (llama.cpp's) within the q8_0
    models' bound."""
    from lucepy.runtime.config import RuntimeConfig
    from lucepy.runtime.engine import Engine

    with Engine(path, RuntimeConfig(threads=2, max_ctx=256), tokenizer=False) as engine:
        ours = engine.prefill(tokens, all_logits=True)
    err = np.linalg.norm(ours - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert err.max() <= 2e-2, err


@pytest.mark.parametrize(
    ("wtype", "encoder", "top"), [("q4_k", encode_q4_k, 15), ("q5_k", encode_q5_k, 31)]
)
def test_scale_min_blocks_hold_their_values(wtype, encoder, top, tmp_path):
    """The tests' Q4_K and Q5_K encoders (gguf-py has none): ggml's block layouts, as gguf-py
    decodes them, each value within its piece's step (the piece's range over 15 or 31, through
    the 6-bit scale) of the original; a wide tiny model of each, every matmul weight of 256-value
    rows in it, loads in llama.cpp, and lucepy's logits on the CPU (ggml's products) are
    llama.cpp's within the q8_0 models' bound."""
    qtype = gguf.GGMLQuantizationType[wtype.upper()]
    rng = np.random.default_rng(3)
    x = (rng.normal(size=(8, 512)) / 8).astype(np.float32)
    x[0, :32] = 0.0  # a piece of zeros
    x[1, 32:64] = np.abs(x[1, 32:64])  # a piece with no negative value (min 0)
    got = gguf.quants.dequantize(encoder(x), qtype).reshape(x.shape)
    pieces = x.reshape(8, 16, 32)
    span = pieces.max(axis=2) - np.minimum(pieces.min(axis=2), 0)
    step = (span / top * 1.1 + 1e-6).repeat(32).reshape(x.shape)
    assert (np.abs(got - x) <= step).all()
    np.testing.assert_array_equal(got[0, :32], 0.0)
    path, tokens, ref = wide_model_in_llama_cpp(tmp_path, wtype, qtype)
    assert_cpu_logits_near(path, tokens, ref)


def test_q6_k_blocks_hold_their_values(tmp_path):
    """The tests' Q6_K encoder (gguf-py has none): ggml's block layout, as gguf-py decodes it,
    each value within half its step (the half piece's largest magnitude over 31, up to d more)
    of the original; a wide tiny model in Q6_K loads in llama.cpp, and lucepy's logits on the CPU
    (ggml's Q6_K products) are llama.cpp's within the q8_0 models' bound."""
    rng = np.random.default_rng(5)
    x = (rng.normal(size=(8, 512)) / 8).astype(np.float32)
    x[0, :16] = 0.0  # a half piece of zeros
    x[1, 16:32] /= 1000  # one far smaller than its block's largest
    blocks = encode_q6_k(x)
    got = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q6_K).reshape(x.shape)
    amax = np.abs(x.reshape(8, 2, 16, 16)).max(axis=3)
    d = blocks.reshape(8, 2, 210)[:, :, 208:].copy().view(np.float16).astype(np.float32)
    bound = ((amax / 31 + d) / 2 * 1.001).repeat(16).reshape(x.shape)
    assert (np.abs(got - x) <= bound).all()
    np.testing.assert_array_equal(got[0, :16], 0.0)
    path, tokens, ref = wide_model_in_llama_cpp(tmp_path, "q6_k", gguf.GGMLQuantizationType.Q6_K)
    assert_cpu_logits_near(path, tokens, ref)


def test_small_tensors_stay_f32(files):
    reader = gguf.GGUFReader(files["odd", "q8_0"])
    types = {t.name: t.tensor_type for t in reader.tensors}
    for name in (
        "blk.0.ssm_a",
        "blk.0.ssm_dt.bias",
        "blk.0.ssm_conv1d.weight",
        "output_norm.weight",
    ):
        assert types[name] == gguf.GGMLQuantizationType.F32
    assert types["blk.2.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0  # (2 + 1) % 3 == 0
    assert "blk.2.attn_qkv.weight" not in types and "blk.1.attn_qkv.weight" in types
    ssm_a = next(t for t in reader.tensors if t.name == "blk.0.ssm_a")
    assert (np.asarray(ssm_a.data) < 0).all()


def test_same_spec_same_bytes(tmp_path):
    a = write_qwen35(tmp_path / "a.gguf", n_layer=2)
    b = write_qwen35(tmp_path / "b.gguf", Qwen35Spec(n_layer=2))
    c = write_qwen35(tmp_path / "c.gguf", n_layer=2, seed=1)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()


def test_vocab():
    vocab = build_vocab(600)
    assert len(vocab.tokens) == len(set(vocab.tokens)) == 600
    assert vocab.tokens[-3:] == SPECIAL_TOKENS
    assert vocab.types[-3:] == (int(gguf.TokenType.CONTROL),) * 3
    assert len(vocab.merges) == 600 - 256 - 3


@pytest.mark.parametrize(
    "bad",
    [
        {"rope_sections": (4, 4, 4, 0)},
        {"rope_dim": 7},
        {"ssm_time_step_rank": 3},
        {"weight_type": "q3_k"},
        {"n_layer": 0},
    ],
)
def test_bad_spec_is_refused(bad):
    with pytest.raises(ConfigError):
        Qwen35Spec(**bad)


def test_cli(tmp_path, capsys):
    out = tmp_path / "cli.gguf"
    assert main([str(out), "--type", "q4_0", "--set", "n_layer=2", "--set", "rope_theta=1e6"]) == 0
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.file_type"].contents() == gguf.LlamaFileType.MOSTLY_Q4_0
    assert reader.fields["qwen35.block_count"].contents() == 2
    assert main([str(out), "--set", "no_such_key=1"]) == 2
    assert "no_such_key" in capsys.readouterr().err

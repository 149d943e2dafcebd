"""Tiny random DFlash drafts for tests, in the GGUF layout of the pinned llama.cpp's ``dflash``.

The draft carries the target's vocabulary (llama.cpp needs one to load it) with
``tokenizer.ggml.mask_token_id``, and shares the target's ``token_embd``/``output`` (it has none).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from lucepy.testing.tiny import Qwen35Spec
from lucepy.testing.vocab import add_vocab, build_vocab

ARCH = "dflash"


@dataclass(frozen=True)
class DraftSpec:
    n_layer: int = 1
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64  # CUDA's flash attention has no kernel for 32
    n_ff: int = 128
    target_layers: tuple[int, ...] = (1, 3)  # capture the residual entering these target layers
    block_size: int = 8
    shared_kv: bool = False  # no attn_v: V is the RMS-normed K projection
    rope_theta: float = 10000.0
    seed: int = 0
    weight_scale: float = 1.0
    # With favor_token set, the draft gets its own embeddings, all with a large dim 0, and its own
    # head, whose favoured row reads dim 0: it then drafts that token almost always. Paired with a
    # target that favours the same token (Qwen35Spec.favor_token), drafts agree often.
    favor_token: int = -1
    favor_scale: float = 0.0


def _tensors(d: DraftSpec, t: Qwen35Spec) -> dict[str, np.ndarray]:
    """numpy arrays, outermost dimension first (the reverse of the GGUF shapes)."""
    rng = np.random.default_rng([d.seed, 1])
    e, hd = t.n_embd, d.head_dim

    def dense(n_in: int, n_out: int) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in)) * d.weight_scale / np.sqrt(n_in)).astype(
            np.float32
        )

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.uniform(-1, 1, n)).astype(np.float32)

    out = {
        "fc.weight": dense(len(d.target_layers) * e, e),
        "enc.output_norm.weight": norm(e),
        "output_norm.weight": norm(e),
    }
    for i in range(d.n_layer):
        b = f"blk.{i}."
        out.update(
            {
                b + "attn_norm.weight": norm(e),
                b + "attn_q.weight": dense(e, hd * d.n_head),
                b + "attn_k.weight": dense(e, hd * d.n_head_kv),
                b + "attn_output.weight": dense(hd * d.n_head, e),
                b + "attn_q_norm.weight": norm(hd),
                b + "attn_k_norm.weight": norm(hd),
                b + "ffn_norm.weight": norm(e),
                b + "ffn_gate.weight": dense(e, d.n_ff),
                b + "ffn_up.weight": dense(e, d.n_ff),
                b + "ffn_down.weight": dense(d.n_ff, e),
            }
        )
        if not d.shared_kv:
            out[b + "attn_v.weight"] = dense(e, hd * d.n_head_kv)
    if d.favor_token >= 0:
        embd = rng.standard_normal((t.n_vocab, e)).astype(np.float32)
        embd[:, 0] += 30.0
        out["token_embd.weight"] = embd
        head = dense(e, t.n_vocab)
        head[d.favor_token, 0] += d.favor_scale
        out["output.weight"] = head
    return out


DRAFT_HPARAMS = ("n_layer", "n_ff", "n_head", "n_head_kv", "head_dim", "rope_theta")
DRAFT_HPARAMS += ("target_layers", "block_size")


def draft_writer(
    path: str | Path, name: str, *, context_length: int, n_embd: int, rms_eps: float, **hp
) -> gguf.GGUFWriter:
    """A GGUFWriter holding a dflash draft's hyperparameters (``DRAFT_HPARAMS``, what the
    pinned ``src/models/dflash.cpp`` reads); the caller adds the vocabulary, the mask token and
    the tensors. tools/dflash_gguf.py writes trained drafts through it too."""
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_name(name)
    w.add_context_length(context_length)
    w.add_embedding_length(n_embd)
    w.add_block_count(hp["n_layer"])
    w.add_feed_forward_length(hp["n_ff"])
    w.add_head_count(hp["n_head"])
    w.add_head_count_kv(hp["n_head_kv"])
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    w.add_layer_norm_rms_eps(rms_eps)
    w.add_rope_freq_base(hp["rope_theta"])
    w.add_array(f"{ARCH}.target_layers", list(hp["target_layers"]))
    w.add_uint32(f"{ARCH}.block_size", hp["block_size"])
    return w


def write_dflash(
    path: str | Path,
    target: Qwen35Spec | None = None,
    spec: DraftSpec | None = None,
    **overrides: object,
) -> Path:
    """Write a random DFlash draft for a tiny target of ``target`` (the default tiny spec)."""
    target = target or Qwen35Spec()
    d = dataclasses.replace(spec or DraftSpec(), **overrides)
    vocab = build_vocab(target.n_vocab)
    w = draft_writer(
        path,
        "lucepy tiny dflash draft",
        context_length=target.context_length,
        n_embd=target.n_embd,
        rms_eps=target.rms_eps,
        **{k: getattr(d, k) for k in DRAFT_HPARAMS},
    )
    add_vocab(w, vocab)
    w.add_uint32("tokenizer.ggml.mask_token_id", vocab.id("<|endoftext|>"))
    for name, values in _tensors(d, target).items():
        w.add_tensor(name, values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


# A target that emits token 300 about two thirds of the time and a draft that nearly always drafts
# it: partial acceptances of every length (tau ~2.35) over a varied continuation.
AGREEING_TARGET = Qwen35Spec(n_layer=4, favor_token=300, favor_scale=2.5)


def write_agreeing_pair(folder: str | Path) -> tuple[Path, Path]:
    """(target, draft) GGUFs in ``folder`` built so that the draft agrees with the target often."""
    folder = Path(folder)
    from lucepy.testing.tiny import write_qwen35

    target = write_qwen35(folder / "favoured.gguf", AGREEING_TARGET)
    draft = write_dflash(
        folder / "agree.gguf",
        AGREEING_TARGET,
        block_size=8,
        target_layers=(1, 3),
        favor_token=300,
        favor_scale=3.0,
    )
    return target, draft

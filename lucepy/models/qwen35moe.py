"""Qwen3.5 / Qwen3.6 MoE (GGUF ``qwen35moe``, e.g. Qwen3.6-35B-A3B): qwen35's Gated DeltaNet and
gated attention layers, with a mixture of experts in place of the dense FFN.

The FFN follows ``build_layer_ffn`` in ``src/models/qwen35moe.cpp`` of the pinned llama.cpp:
softmax routing over ``n_expert`` experts, the top ``n_expert_used`` with weights normalised to
sum to one (``models/moe.py``), SwiGLU experts, plus a shared expert whose output is gated by
``sigmoid(ffn_gate_inp_shexp x)``. An MTP block, when the file has one, is left alone as in qwen35.
"""

from __future__ import annotations

from dataclasses import dataclass

from lucepy.errors import ConfigError
from lucepy.gguf import GGUFFile
from lucepy.models import moe, qwen35
from lucepy.models.base import metadata
from lucepy.models.builder import Builder, Tensor


@dataclass(frozen=True)
class Params(qwen35.Params):
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int  # 0: no shared expert
    expert_scale: float  # the chosen weights' factor after normalising (0 or 1: none)

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> Params:
        key = metadata(f)
        p = cls(
            **qwen35.Params.fields(f),
            n_expert=int(key("expert_count")),
            n_expert_used=int(key("expert_used_count")),
            n_ff_exp=int(key("expert_feed_forward_length")),
            n_ff_shexp=int(key("expert_shared_feed_forward_length", 0)),
            expert_scale=float(key("expert_weights_scale", 0.0)),
        )
        if not 0 < p.n_expert_used <= p.n_expert:
            raise ConfigError(f"{f.path}: {p.n_expert_used} of {p.n_expert} experts per token")
        return p


class Qwen35Moe(qwen35.Qwen35):
    gguf_name = "qwen35moe"
    params = Params

    def _ffn_shapes(self, il: int) -> dict[str, tuple]:
        p, b = self.p, f"blk.{il}."
        E, X, ff = p.n_embd, p.n_expert, p.n_ff_exp
        out = {
            b + "ffn_gate_inp.weight": (E, X),
            b + "ffn_gate_exps.weight": (E, ff, X),
            b + "ffn_up_exps.weight": (E, ff, X),
            b + "ffn_down_exps.weight": (ff, E, X),
        }
        if p.n_ff_shexp:
            sh = p.n_ff_shexp
            out |= {
                b + "ffn_gate_inp_shexp.weight": (E, 1),
                b + "ffn_gate_shexp.weight": (E, sh),
                b + "ffn_up_shexp.weight": (E, sh),
                b + "ffn_down_shexp.weight": (sh, E),
            }
        return out

    def _ffn(self, g: Builder, w: dict, il: int, x: Tensor) -> Tensor:
        p, L, c, b = self.p, g.lib, g.ctx, f"blk.{il}."
        logits = L.ggml_mul_mat(c, w[b + "ffn_gate_inp.weight"], x)  # [n_expert, T]
        r = moe.route(g, logits, p.n_expert_used, p.expert_scale, layer=il)
        out = moe.layer_experts(g, w, b, x, r)
        if not p.n_ff_shexp:
            return out
        shared = g.swiglu_ffn(
            x, w[b + "ffn_gate_shexp.weight"], w[b + "ffn_up_shexp.weight"],
            w[b + "ffn_down_shexp.weight"],
        )  # fmt: skip
        gate = L.ggml_sigmoid(c, L.ggml_mul_mat(c, w[b + "ffn_gate_inp_shexp.weight"], x))
        return L.ggml_add(c, out, L.ggml_mul(c, shared, gate))

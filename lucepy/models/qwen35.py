"""Qwen3.5 / Qwen3.6 dense hybrid (GGUF ``qwen35``): Gated DeltaNet layers plus gated attention.

The math follows ``src/models/qwen35.cpp`` and ``src/models/delta-net-base.cpp`` of the pinned
llama.cpp (0c1e57098), using the fused ``ggml_gated_delta_net`` for prefill and decode as llama.cpp
does by default. Shapes are in ggml order (see ``models/base.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lucepy.errors import ConfigError
from lucepy.ggml import ffi
from lucepy.gguf import GGUFFile
from lucepy.models.base import (
    Architecture,
    DecoderParams,
    GraphSpec,
    ModelOptions,
    check_tensors,
    metadata,
    rope_args,
)
from lucepy.models.batch import StepBatch, StepInput
from lucepy.models.builder import Builder, Tensor
from lucepy.models.state import DeltaNetState, LayerState

# tokens of a step up to which lucepy's CUDA gated norm reads z in place (norm_gate_halves, 2-16
# columns): past them a prefill chunk's stacked products are not kept (about 1.6 GB at 512
# tokens for the 27B-shaped model's 48 layers)
_GATE_IN_PLACE = 16

GGML_ROPE_TYPE_IMROPE = 40
# the 2D weights that graphs use only as mul_mat's first operand (not norms, conv, get_rows)
_MATMUL_SUFFIXES = ("_qkv.weight", "_gate.weight", "_q.weight", "_k.weight", "_v.weight")
_MATMUL_SUFFIXES += ("_output.weight", "_beta.weight", "_alpha.weight", "ssm_out.weight")
_MATMUL_SUFFIXES += ("ffn_up.weight", "ffn_down.weight", "_shexp.weight", "_exps.weight")
# products of one input that the loader stacks into one (Architecture.stacked), the first that
# can be of those sharing a weight: a delta-net layer's four input projections as one (beta's
# and alpha's 2 x 48 rows of the 27B-shaped model ride along in the large product: a decode
# launches 48 mat-vecs fewer, a verify 48 products and their sums, docs/BENCHMARKS.md), else
# in the largest groups their types allow: llama-quantize's Q4_K_M gives the DeltaNet's qkv Q5_K
# and the rest Q4_K (z, beta and alpha one product), and half the attention layers' V Q6_K (Q
# and K one). (A CPU may repack the small pair otherwise than the rest: the loader then keeps
# that stack apart.)
_STACKS = {
    "ssm_in.stacked": ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha"),
    "ssm_qkvz.stacked": ("attn_qkv", "attn_gate"),
    "ssm_zba.stacked": ("attn_gate", "ssm_beta", "ssm_alpha"),
    "ssm_ba.stacked": ("ssm_beta", "ssm_alpha"),
    "attn_qkv.stacked": ("attn_q", "attn_k", "attn_v"),
    "attn_qk.stacked": ("attn_q", "attn_k"),
}


@dataclass(frozen=True)
class Params(DecoderParams):
    rope_sections: tuple[int, int, int, int]
    ssm_conv_kernel: int
    ssm_state: int  # key and value head dim of the delta net
    ssm_k_heads: int  # ssm.group_count
    ssm_v_heads: int  # ssm.time_step_rank
    recurrent: tuple[bool, ...]  # per layer: Gated DeltaNet (True) or full attention (False)

    @property
    def key_dim(self) -> int:
        return self.ssm_state * self.ssm_k_heads

    @property
    def value_dim(self) -> int:
        return self.ssm_state * self.ssm_v_heads

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> Params:
        return cls(**cls.fields(f))

    @staticmethod
    def fields(f: GGUFFile) -> dict:
        key = metadata(f)
        n_layer = int(key("block_count")) - int(key("nextn_predict_layers", 0))  # less MTP
        sections = list(key("rope.dimension_sections", [0, 0, 0, 0]))[:4]
        return dict(
            **DecoderParams.common(f, n_layer),
            rope_sections=tuple(sections + [0] * (4 - len(sections))),
            ssm_conv_kernel=int(key("ssm.conv_kernel")),
            ssm_state=int(key("ssm.state_size")),
            ssm_k_heads=int(key("ssm.group_count")),
            ssm_v_heads=int(key("ssm.time_step_rank")),
            recurrent=_layer_kinds(key, n_layer),
        )


def _layer_kinds(key, n_layer: int) -> tuple[bool, ...]:
    explicit = key("attention.recurrent_layers", None)
    if explicit is not None:
        return tuple(bool(x) for x in list(explicit)[:n_layer])
    interval = int(key("full_attention_interval", 4))
    return tuple((i + 1) % interval != 0 for i in range(n_layer))


class Qwen35(Architecture):
    gguf_name = "qwen35"

    def __init__(self, params: Params, options: ModelOptions = ModelOptions()):  # noqa: B008
        self.p, self.options = params, options

    params = Params

    @classmethod
    def from_gguf(cls, f: GGUFFile, options: ModelOptions = ModelOptions()) -> Qwen35:  # noqa: B008
        model = cls(cls.params.from_gguf(f), options)
        check_tensors(f, model.weight_shapes(range(model.p.n_layer), f))
        return model

    # what a layer range owns
    def weight_shapes(self, layers: range, f: GGUFFile | None = None) -> dict[str, tuple]:
        out = self.end_shapes(layers, f)
        for il in layers:
            out.update(self._layer_shapes(il))
        return out

    def matmul_weights(self, layers: range, f: GGUFFile) -> dict[str, str]:
        """The weights of ``layers`` used only as mul_mat's first operand (graph key -> GGUF
        tensor): the ones a CPU may keep repacked. A tied head reads ``token_embd`` as
        ``output.weight``; where the embedding's get_rows needs it too, that is a second copy."""
        out = {
            n: n
            for n in self.weight_shapes(layers, f)
            if n.startswith("blk.") and n.endswith(_MATMUL_SUFFIXES)
        }
        return self.stack_all(f, layers, _STACKS, out) | self.head_matmul(layers, f)

    def _layer_shapes(self, il: int) -> dict[str, tuple]:
        p, b = self.p, f"blk.{il}."
        s = {b + "attn_norm.weight": (p.n_embd,), b + "post_attention_norm.weight": (p.n_embd,)}
        if p.recurrent[il]:
            s.update(
                {
                    b + "attn_qkv.weight": (p.n_embd, p.conv_dim),
                    b + "attn_gate.weight": (p.n_embd, p.value_dim),
                    b + "ssm_conv1d.weight": (p.ssm_conv_kernel, p.conv_dim),
                    b + "ssm_dt.bias": (p.ssm_v_heads,),
                    b + "ssm_a": (p.ssm_v_heads,),
                    b + "ssm_beta.weight": (p.n_embd, p.ssm_v_heads),
                    b + "ssm_alpha.weight": (p.n_embd, p.ssm_v_heads),
                    b + "ssm_norm.weight": (p.ssm_state,),
                    b + "ssm_out.weight": (p.value_dim, p.n_embd),
                }
            )
        else:
            hd = p.head_dim
            s.update(
                {
                    b + "attn_q.weight": (p.n_embd, 2 * hd * p.n_head),  # query and output gate
                    b + "attn_k.weight": (p.n_embd, hd * p.n_head_kv),
                    b + "attn_v.weight": (p.n_embd, hd * p.n_head_kv),
                    b + "attn_output.weight": (hd * p.n_head, p.n_embd),
                    b + "attn_q_norm.weight": (hd,),
                    b + "attn_k_norm.weight": (hd,),
                }
            )
        return s | self._ffn_shapes(il)

    def _ffn_shapes(self, il: int) -> dict[str, tuple]:
        p, b = self.p, f"blk.{il}."
        return {
            b + "ffn_gate.weight": (p.n_embd, p.n_ff),
            b + "ffn_up.weight": (p.n_embd, p.n_ff),
            b + "ffn_down.weight": (p.n_ff, p.n_embd),
        }

    def make_state(self, layers: range, n_ctx: int) -> list[LayerState]:
        """Per layer: the delta net's conv and recurrent state, or attention KV rows."""
        p, out = self.p, []
        for il in layers:
            if p.recurrent[il]:
                conv = DeltaNetState(
                    il, p.ssm_conv_kernel - 1, p.conv_dim, p.ssm_state, p.ssm_v_heads,
                    p.ssm_k_heads, self.options.n_seq,
                )  # fmt: skip
                out.append(conv)
            else:
                out.append(self.options.kv_cache(il, p.head_dim, p.n_head_kv, n_ctx))
        return out

    def step_inputs(self, batch: StepBatch, names) -> dict[str, StepInput]:
        """IMROPE positions (4 sections, the last all 0), the causal mask and the cache rows."""
        out = {"tokens": batch.tokens}
        if "pos" in names:
            pos = batch.pos
            out["pos"] = np.concatenate([pos, pos, pos, np.zeros_like(pos)])
            out["mask"] = batch.mask_input()
            out["rows"] = batch.slots
        return {k: v for k, v in out.items() if k in names}

    # graph
    def build(
        self,
        g: Builder,
        w: dict[str, Tensor],
        st: dict[str, Tensor],
        layers: range,
        spec: GraphSpec,
    ) -> Tensor:
        """The forward of ``layers`` for ``spec.n_tokens`` new tokens over ``spec.n_kv`` cache rows.

        Inputs: ``tokens`` (first shard) or ``x``; ``pos`` and, with attention layers, ``mask`` and
        ``rows`` (cache rows to write). Returns logits on the last shard, else the activation.
        Extra outputs go to ``g.outputs``: ``argmax``, ``feat.L`` (the residual entering layer L),
        and in verify graphs what ``DeltaNetState.rollback`` reads: ``conv.il`` and the
        ``gdn_*.il`` (the recurrence's state before the step and its inputs).
        """
        p, L, c, T = self.p, g.lib, g.ctx, spec.n_tokens
        if spec.n_kv > 0 and T // max(spec.streams[0], 1) > spec.n_kv:  # per sequence
            raise ConfigError(f"{T} tokens do not fit a {spec.n_kv}-row attention window")
        if layers.start == 0:
            x = L.ggml_get_rows(c, w["token_embd.weight"], g.input_i32("tokens", T))
        else:
            x = g.carried_f32("x", p.n_embd, T)  # [n_embd, T]
        if not all(p.recurrent[il] for il in layers):
            g.input_i32("pos", 4 * T)  # IMROPE: 4 sections of positions, the last all 0
            g.input_f16("mask", spec.n_kv, T)  # 0 where a token may attend, -inf elsewhere
            g.input_i64("rows", T)
        for il in layers:
            if il in spec.capture:
                g.output(f"feat.{il}", x)
            x = self._layer(g, w, st, il, x, spec)
        if layers.stop < p.n_layer:
            return x
        if p.n_layer in spec.capture:  # "entering" the layer after the last: the final residual
            g.output(f"feat.{p.n_layer}", x)
        if spec.logits == "last":
            x = g.last_row(x)
        x = g.rms_norm(x, w["output_norm.weight"], p.rms_eps)
        head = w.get("output.weight", w.get("token_embd.weight"))
        logits = L.ggml_mul_mat(c, head, x)  # [n_vocab, T or 1]
        g.output("argmax", L.ggml_argmax(c, logits))  # [T or 1] i32: greedy needs no logits copy
        return logits

    def _layer(self, g: Builder, w: dict, st: dict, il: int, x: Tensor, spec: GraphSpec) -> Tensor:
        p, L, c, b, T = self.p, g.lib, g.ctx, f"blk.{il}.", spec.n_tokens
        h = g.rms_norm(x, w[b + "attn_norm.weight"], p.rms_eps)
        if p.recurrent[il]:
            h = self._delta_net(g, w, st, il, h, T, spec.verify)
        else:
            h = self._attention(g, w, st, il, h, T)
        x = L.ggml_add(c, h, x)
        h = g.rms_norm(x, w[b + "post_attention_norm.weight"], p.rms_eps)
        return L.ggml_add(c, self._ffn(g, w, il, h), x)

    def _ffn(self, g: Builder, w: dict, il: int, x: Tensor) -> Tensor:
        b = f"blk.{il}."
        return g.swiglu_ffn(
            x, w[b + "ffn_gate.weight"], w[b + "ffn_up.weight"], w[b + "ffn_down.weight"]
        )

    def _attention(self, g: Builder, w: dict, st: dict, il: int, x: Tensor, T: int) -> Tensor:
        p, L, c, b = self.p, g.lib, g.ctx, f"blk.{il}."
        hd, nh, nkv = p.head_dim, p.n_head, p.n_head_kv
        rows = {"attn_q": 2 * hd * nh, "attn_k": hd * nkv, "attn_v": hd * nkv}
        # q, k and v stay views of a stack's product for any T (their norms, rope and set_rows
        # read strided columns): a step of several tokens copies none of them out (ggml-cuda
        # copied each with a 2D memcpy, outside the PDL chain)
        y = g.products(w, x, b, rows, _STACKS, views=tuple(rows))
        qg = y["attn_q"]  # [2*hd*nh, T]: per head, query then gate; columns qg.nb[1] apart
        es = L.ggml_element_size(qg)
        q = L.ggml_view_3d(c, qg, hd, nh, T, es * hd * 2, qg.nb[1], 0)  # [hd, nh, T]
        gate = L.ggml_view_3d(c, qg, hd, nh, T, es * hd * 2, qg.nb[1], es * hd)
        gate = L.ggml_cont_2d(c, gate, hd * nh, T)
        q = g.rms_norm(q, w[b + "attn_q_norm.weight"], p.rms_eps)
        k = g.rms_norm(g.heads(y["attn_k"], hd), w[b + "attn_k_norm.weight"], p.rms_eps)
        v = g.heads(y["attn_v"], hd)  # [hd, nkv, T]
        q, k = self._rope(g, q), self._rope(g, k)
        cache, scale = self.kv_state(il), 1.0 / math.sqrt(hd)
        attn = g.cached_attention(cache, st, q, k, v, scale, self.options.flash_attn)  # [hd*nh, T]
        attn = L.ggml_mul(c, attn, L.ggml_sigmoid(c, gate))
        return L.ggml_mul_mat(c, w[b + "attn_output.weight"], attn)  # [n_embd, T]

    def _rope(self, g: Builder, t: Tensor) -> Tensor:
        p = self.p
        sections = ffi.new("int[4]", list(p.rope_sections))
        return g.lib.ggml_rope_multi(
            g.ctx,
            t,
            g.inputs["pos"],
            ffi.NULL,
            p.rope_dim,
            sections,
            GGML_ROPE_TYPE_IMROPE,
            *rope_args(p.n_ctx_train, p.rope_theta),
        )

    def _delta_net(
        self, g: Builder, w: dict, st: dict, il: int, x: Tensor, T: int, verify: bool
    ) -> Tensor:
        p, L, c, b = self.p, g.lib, g.ctx, f"blk.{il}."
        S, Hk, Hv = p.ssm_state, p.ssm_k_heads, p.ssm_v_heads
        # batched sequences (GraphSpec.streams): N of them from sequence F, t tokens each, each
        # with its own slice of the state; otherwise sequence 0 alone
        N, _, F = g.streams if g.streams[0] else (1, 0, 0)
        t = T // N
        rows = {"attn_qkv": p.conv_dim, "attn_gate": p.value_dim, "ssm_beta": Hv, "ssm_alpha": Hv}
        # qkv and alpha stay views of a stack's product for any T (the conv and the ADD read
        # strided columns); z and beta are copied out for T > 1 (the gated norm's kernel and
        # ggml-cuda's sigmoid take rows back to back; lucepy's CUDA gates' kernel reads beta in
        # place, the copy then not made)
        y = g.products(w, x, b, rows, _STACKS, views=("attn_qkv", "ssm_alpha"))
        qkv = y["attn_qkv"]  # [conv_dim, T]
        z = y["attn_gate"]  # [value_dim, T]
        beta = L.ggml_sigmoid(c, y["ssm_beta"])  # [Hv, T]
        alpha = y["ssm_alpha"]  # [Hv, T]
        alpha = L.ggml_softplus(c, L.ggml_add(c, alpha, w[b + "ssm_dt.bias"]))
        decay = L.ggml_mul(c, alpha, w[b + "ssm_a"])  # [Hv, T]

        conv = self._conv(g, w, st, il, qkv, (t, N, F), verify)  # [conv_dim, t, N] after SiLU
        es, row = L.ggml_element_size(conv), conv.nb[1]
        # q's and k's heads side by side, normalized by one op (not two: a kernel fewer a layer)
        qk = L.ggml_view_4d(c, conv, S, 2 * Hk, t, N, es * S, row, row * t, 0)
        qk = self._l2_norm(g, qk)  # [S, 2 Hk, t, N]
        if verify:  # the recurrence's inputs, for DeltaNetState.rollback to run it again
            for name, tensor in (("qk", qk), ("x", conv), ("decay", decay), ("beta", beta)):
                g.output(f"gdn_{name}.{il}", tensor)
        beta = L.ggml_reshape_4d(c, beta, 1, Hv, t, N)
        decay = L.ggml_reshape_4d(c, decay, 1, Hv, t, N)
        nb1, nb2, nb3 = qk.nb[1], qk.nb[2], qk.nb[3]
        q = L.ggml_view_4d(c, qk, S, Hk, t, N, nb1, nb2, nb3, 0)
        k = L.ggml_view_4d(c, qk, S, Hk, t, N, nb1, nb2, nb3, nb1 * Hk)
        v = L.ggml_view_4d(c, conv, S, Hv, t, N, es * S, row, row * t, es * 2 * p.key_dim)

        n = S * S * Hv  # one sequence's state
        state = st[f"ssm.{il}"]  # [S, S, Hv] or [S, S, Hv, n_seq]
        fs = L.ggml_element_size(state)
        mine = L.ggml_view_1d(c, state, n * N, fs * n * F)  # these sequences' slices
        s0 = L.ggml_reshape_4d(c, mine, S, S, Hv, N)
        if verify:  # the state before it, kept for a rollback (the copy is what the op reads)
            s0 = g.output(f"gdn_s0.{il}", L.ggml_dup(c, s0))
        res = L.ggml_gated_delta_net(c, q, k, v, decay, beta, s0, 1)
        out = L.ggml_view_4d(c, res, S, Hv, t, N, fs * S, fs * S * Hv, fs * S * Hv * t, 0)
        new_state = L.ggml_view_1d(c, res, n * N, fs * S * Hv * T)
        L.ggml_build_forward_expand(g.gf, L.ggml_cpy(c, new_state, mine))

        if T <= _GATE_IN_PLACE and z.op == L.GGML_OP_CONT and z.src[0].view_src != ffi.NULL:
            # z is a copy out of the stacked product (a verify's): the product stays unreused
            # (an output) through the gated norm, which lucepy's CUDA kernels then compute reading
            # z in place, the copy (ggml-cuda's 2D memcpy, outside the PDL chain) not made
            L.ggml_set_output(z.src[0].view_src)
        z4 = L.ggml_reshape_4d(c, z, S, Hv, t, N)
        # z's copy out of the stacked product (T > 1) computed here, not between the output's
        # norm and its gate, so that the gated norm's nodes stay back to back (lucepy's CUDA
        # kernels compute them, and the product's halves, as one kernel). (Computed right after
        # the product instead, the conv step was ggml's kernels in 44 of the 27B-shaped model's
        # 48 verify layers: the allocator placed its tensors otherwise, most likely.)
        L.ggml_build_forward_expand(g.gf, z4)
        out = L.ggml_mul(
            c, g.rms_norm(out, w[b + "ssm_norm.weight"], p.rms_eps), L.ggml_silu(c, z4)
        )
        out = L.ggml_reshape_2d(c, out, p.value_dim, T)
        return L.ggml_mul_mat(c, w[b + "ssm_out.weight"], out)  # [n_embd, T]

    def _conv(
        self, g: Builder, w: dict, st: dict, il: int, qkv: Tensor, seqs: tuple, verify: bool
    ) -> Tensor:
        """Causal depthwise conv over [saved d_conv-1 columns | this step], saving the new tail;
        ``seqs``: (t tokens, N sequences, from sequence F), each with its own saved columns."""
        p, L, c = self.p, g.lib, g.ctx
        (t, N, F), K1, C = seqs, p.ssm_conv_kernel - 1, p.conv_dim
        state = st[f"conv.{il}"]  # [K1, C] or [K1, C, n_seq]
        plane = state.nb[1] * C
        mine = L.ggml_view_3d(c, state, K1, C, N, state.nb[1], plane, plane * F)
        steps = L.ggml_view_3d(c, qkv, C, t, N, qkv.nb[1], qkv.nb[1] * t, 0)  # (a view: strided)
        steps = L.ggml_permute(c, steps, 1, 0, 2, 3)  # [t, C, N]
        x = L.ggml_concat(c, mine, steps, 0)  # [K1 + t, C, N]
        if verify:
            g.output(f"conv.{il}", x)  # the state after token t is columns t+1 .. t+K1
        tail = L.ggml_view_3d(c, x, K1, C, N, x.nb[1], x.nb[2], g.row_size(x, t))
        # into a flat view of the same elements: a copy of like shapes ggml-cuda makes a 2D
        # memcpy, 7 us a layer on the H200 (CUDA's own kernel, outside the PDL chain), where its
        # copy kernel takes about 2 (docs/BENCHMARKS.md)
        flat = L.ggml_view_1d(c, state, K1 * C * N, plane * F)
        L.ggml_build_forward_expand(g.gf, L.ggml_cpy(c, tail, flat))
        out = L.ggml_silu(c, L.ggml_ssm_conv(c, x, w[f"blk.{il}.ssm_conv1d.weight"]))  # [C, t, N]
        # the concat, the copy, the conv and its SiLU one after another (and the l2 norm of q
        # and k, which the caller builds next): lucepy's CUDA kernels compute them in one kernel
        # (conv_step, vendor/ggml/cuda)
        L.ggml_build_forward_expand(g.gf, out)
        return out

    def _l2_norm(self, g: Builder, t: Tensor) -> Tensor:
        # x / max(||x||, eps) as llama.cpp writes it: rms_norm with eps/n, then scale by 1/sqrt(n)
        n = t.ne[0]
        L = g.lib
        return L.ggml_scale(
            g.ctx, L.ggml_rms_norm(g.ctx, t, self.p.rms_eps / n), 1.0 / math.sqrt(n)
        )

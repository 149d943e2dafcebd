"""Build small GGUF fixtures the way users' files are made: HF checkpoint -> llama.cpp converter.

Random-weight Hugging Face checkpoints (a tied llama, an untied llama of odd width, a Qwen3.5 and a
Qwen3.5 MoE, each with an MTP block, two Gemma 4, two Laguna) are converted by the pinned
llama.cpp's own ``convert_hf_to_gguf.py``, run from a temp extraction of the llama-cpp-python sdist
(nothing of it is copied into this repo), and then quantized by libllama. Everything is seeded,
so a rerun with the same versions gives the same files.

The build stage needs torch, transformers 5.x, tokenizers and safetensors; keep them in their own
venv. The quantize and check stages need ``llama_cpp`` and ``lucepy`` and run under
``--llama-python`` (default ``python3``, where ``pip install -e .`` put them)::

    python3 -m venv /tmp/hfvenv
    /tmp/hfvenv/bin/pip install torch==2.13.0 'transformers==5.23.*' tokenizers safetensors numpy
    /tmp/hfvenv/bin/python tools/make_hf_fixtures.py tests/fixtures/hf \\
        --sdist /tmp/sdist/llama_cpp_python-0.3.36.tar.gz

Without ``--sdist`` the sdist is fetched with ``pip download``. ``--stage quantize`` and
``--stage check`` run one stage alone; check loads every fixture in llama.cpp and in lucepy.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PIN = "0.3.36"  # llama-cpp-python; its vendored llama.cpp is the converter we trust
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_VOCAB = 380
VOCAB = 384  # model rows; the 4 past the tokenizer become [PAD] tokens, as in padded real vocabs
PRE_TOKENIZER = "gpt-2"  # llama.cpp's GPT-2 regex is the one HF's ByteLevel pre-tokenizer uses
CHAT_TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
SAMPLE = (
    "The quick brown fox jumps over the lazy dog. Beautiful is better than ugly; "
    "explicit is better than implicit. def main(argv=None): return 0  # 12345"
)
CONVERT_TYPES = ("f32", "f16", "q8_0")
QUANT_TYPES = {"q4_0": "q4_0", "q4_k_m": "q4_K_M"}  # file suffix -> lucepy.testing.quantize type
# what is kept (and committed, about 15.6 MB): every weight type for llama-tied and qwen35, fewer
# for the variants whose point is the untied head, the MTP block or the MoE block
COMMITTED = {
    f"{m}-{t}" for m in ("llama-tied", "qwen35") for t in ("f32", "q8_0", "q4_0", "q4_k_m")
}
COMMITTED |= {"llama-tied-f16", "llama-untied-f32", "llama-untied-q8_0", "llama-untied-q4_k_m"}
COMMITTED |= {"qwen35-mtp-q8_0"}
COMMITTED |= {f"gemma4-{t}" for t in ("f32", "q8_0", "q4_0")}
COMMITTED |= {"gemma4-moe-f32", "gemma4-moe-q8_0"}
COMMITTED |= {"qwen35moe-f32", "qwen35moe-q8_0", "qwen35moe-mtp-q8_0"}
COMMITTED |= {f"laguna-{m}-{t}" for m in ("xs", "m") for t in ("f32", "q8_0")}
INIT_STD = 0.1  # 5x transformers' default, so random logits are far from uniform
MIN_LOGIT_STD = 0.5

LLAMA_TIED = dict(
    hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=160, tie_word_embeddings=True, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)  # fmt: skip
LLAMA_UNTIED = dict(
    hidden_size=96, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
    head_dim=32, intermediate_size=256, tie_word_embeddings=False, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
)  # fmt: skip
QWEN35 = dict(
    hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, intermediate_size=160, tie_word_embeddings=True, rms_norm_eps=1e-6,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4,
    rope_parameters={
        "rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
        "mrope_section": [3, 3, 2], "mrope_interleaved": True,  # 8 = rope dims 16 / 2
    },
)  # fmt: skip

# Qwen3.5/3.6 MoE (35B-A3B) in small: QWEN35's trunk with a sparse MoE block in every layer (8
# routed experts of 32, top 2, plus a sigmoid-gated shared expert of 96) and an untied output,
# as the released MoE checkpoints have. Every row is a whole number of 32-blocks, so q8_0 and q4_0
# quantize all matrices
QWEN35MOE = dict(
    hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, tie_word_embeddings=False, rms_norm_eps=1e-6,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=96, rope_parameters=dict(QWEN35["rope_parameters"]),
)  # fmt: skip

# Gemma 4: a sliding/full layout whose last non-shared layers are sliding then full, so the KV
# source of every shared layer is the same by HF's rule (last non-shared layer of its type) and
# llama.cpp's (n_kv_from_start - 2 for sliding, - 1 for full)
GEMMA4 = dict(
    hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, global_head_dim=32, num_global_key_value_heads=1, intermediate_size=96,
    layer_types=["sliding_attention"] * 3 + ["full_attention", "sliding_attention"]
    + ["full_attention"],
    sliding_window=12, num_kv_shared_layers=2, hidden_size_per_layer_input=8,
    use_double_wide_mlp=True, attention_k_eq_v=True, final_logit_softcapping=30.0,
    tie_word_embeddings=True, rms_norm_eps=1e-6,
)  # fmt: skip
GEMMA4_MOE = dict(
    hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, global_head_dim=32, num_global_key_value_heads=1, intermediate_size=64,
    layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=12,
    hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
    moe_intermediate_size=32, attention_k_eq_v=True, final_logit_softcapping=30.0,
    tie_word_embeddings=True, rms_norm_eps=1e-6,
)  # fmt: skip
# Laguna XS.2 in small: 5 layers, full attention at 0 and 4 and sliding (window 12) between, as
# the period-4 pattern llama.cpp assumes (the converter writes none); query heads per layer (4 on
# full layers, 6 on sliding ones; 2 KV heads of 32), a per-head softplus gate, a leading dense
# layer, then 8 sigmoid-routed experts of 32 (top 3, score-correction bias, routed scale 2.5) and a
# shared expert of 64; YaRN (factor 4 over 512) on the full layers' 16 rotated dims, plain RoPE on
# the sliding layers' 32. Untied, as XS.2
LAGUNA_XS = dict(
    hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, num_attention_heads_per_layer=[4, 6, 6, 6, 4], intermediate_size=96,
    layer_types=["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"],
    sliding_window=12, gating=True, mlp_layer_types=["dense"] + ["sparse"] * 4,
    num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
    shared_expert_intermediate_size=64, moe_routed_scaling_factor=2.5,
    tie_word_embeddings=False, rms_norm_eps=1e-6,
    rope_parameters={
        "full_attention": {
            "rope_type": "yarn", "rope_theta": 500000.0, "partial_rotary_factor": 0.5,
            "factor": 4.0, "original_max_position_embeddings": 512,
        },
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
)  # fmt: skip
# Laguna M.1 in small: every layer full attention (no sliding window), 4 heads in every layer, a
# per-element gate, 2 leading dense layers, plain RoPE on half of each head
LAGUNA_M = dict(
    hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, intermediate_size=96, layer_types=["full_attention"] * 4, sliding_window=0,
    gating="per-element", mlp_layer_types=["dense"] * 2 + ["sparse"] * 2,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, moe_routed_scaling_factor=1.0,
    tie_word_embeddings=False, rms_norm_eps=1e-5,
    rope_parameters={
        "full_attention": {
            "rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5,
        },
    },
)  # fmt: skip
GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
GEMMA_MARKERS = ["<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>"]
GEMMA_MARKERS += ["<|tool_response>", "<tool_response|>", '<|"|>']
# A compact template in the Gemma 4 prompt format (turns, tool declarations, calls and results
# folded into the model turn as ``tool_responses``), written for these fixtures
GEMMA_TEMPLATE = (
    '{%- macro arg(v) -%}{%- if v is string -%}<|"|>{{ v }}<|"|>{%- elif v is mapping -%}'
    "{{ '{' }}{%- for k, x in v | dictsort -%}{{ k }}:{{ arg(x) }}{{ ',' if not loop.last }}"
    "{%- endfor -%}{{ '}' }}{%- else -%}{{ v | tojson }}{%- endif -%}{%- endmacro -%}"
    "{%- set rest = messages -%}"
    "{%- if messages and messages[0]['role'] == 'system' or tools -%}<|turn>system{{ '\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}{{ messages[0]['content'] }}"
    "{%- set rest = messages[1:] -%}{%- endif -%}"
    "{%- for t in tools or [] -%}<|tool>declaration:{{ t['function']['name'] }}"
    "{description:<|\"|>{{ t['function']['description'] or '' }}<|\"|>}<tool|>{%- endfor -%}"
    "<turn|>{{ '\\n' }}{%- endif -%}"
    "{%- for m in rest -%}<|turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}"
    "{{ '\\n' }}"
    "{%- for c in m.get('tool_calls') or [] -%}<|tool_call>call:{{ c['function']['name'] }}"
    "{%- if c['function']['arguments'] is mapping -%}{{ arg(c['function']['arguments']) }}"
    "{%- else -%}{{ c['function']['arguments'] }}{%- endif -%}<tool_call|>{%- endfor -%}"
    "{%- for r in m.get('tool_responses') or [] -%}<|tool_response>response:{{ r['name'] }}"
    "{{ arg(r['response']) if r['response'] is mapping else '{value:' + arg(r['response']) + '}' }}"
    "<tool_response|>{%- endfor -%}"
    "{{ m['content'] or '' }}<turn|>{{ '\\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|turn>model{{ '\\n' }}{%- endif -%}"
)

# runs the sdist's converter as is; only a failed pre-tokenizer hash check gets a name
_CONVERT = """
import sys
root, pre = sys.argv.pop(1), sys.argv.pop(1)
sys.path.insert(0, root)
import convert_hf_to_gguf as cli
from conversion.base import TextModel
hash_check = TextModel.get_vocab_base_pre
def named(self, tokenizer):
    try:
        return hash_check(self, tokenizer)
    except NotImplementedError:  # a freshly trained vocab has no known hash
        return pre
TextModel.get_vocab_base_pre = named
sys.argv[0] = "convert_hf_to_gguf.py"
cli.main()
"""


# --- tokenizer -------------------------------------------------------------------------------


def corpus() -> list[str]:
    """Text already on every machine: stdlib docstrings (the build prints their sha256)."""
    import argparse as a
    import difflib
    import json as j
    import shlex
    import string
    import textwrap

    docs = [m.__doc__ or "" for m in (a, difflib, j, shlex, string, textwrap)]
    docs += [f.__doc__ or "" for f in (str.split, str.join, dict.get, list.sort, sorted, zip)]
    return [SAMPLE] + docs


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte stays encodable
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer)
    assert tok.get_vocab_size() == TOKENIZER_VOCAB, tok.get_vocab_size()
    return tok


def write_tokenizer(tok, out: Path, add_bos: bool) -> None:
    """Llama-style files prepend BOS through the post-processor; Qwen-style ones add nothing."""
    from tokenizers import processors

    bos, eos = SPECIALS[0], SPECIALS[2]
    if add_bos:
        ids = [(bos, tok.token_to_id(bos))]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A $B:1", special_tokens=ids
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # use tokenizer.json as is
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": bos,
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def gemma_tokenizer():
    """The SentencePiece-style BPE Gemma 4 files carry: spaces become "▁", unknown bytes fall back
    to ``<0xXX>`` tokens, and the turn and tool markers are tokens of their own. The merges are
    learned from the corpus, split before each "▁"."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        trainers,
    )

    t = Tokenizer(models.BPE())
    t.normalizer = normalizers.Replace(" ", "\u2581")
    t.pre_tokenizer = pre_tokenizers.Split("\u2581", behavior="merged_with_next")
    t.train_from_iterator(corpus(), trainers.BpeTrainer(vocab_size=200, show_progress=False))
    learned = json.loads(t.to_str())["model"]
    vocab = {s: i for i, s in enumerate(GEMMA_SPECIALS + GEMMA_MARKERS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for s, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(s, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    bpe = models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>")
    tok = Tokenizer(bpe)
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.add_special_tokens([AddedToken(s, special=True) for s in GEMMA_SPECIALS])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in GEMMA_MARKERS])
    return tok


def write_gemma_tokenizer(tok, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 2048,
        "chat_template": GEMMA_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


# --- checkpoints -----------------------------------------------------------------------------


def build_checkpoint(out: Path, kind: str, spec: dict, tok, seed: int) -> float:
    """Save a random checkpoint (bf16, as released ones are); return its logit std."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        Gemma4TextConfig,
        LagunaConfig,
        LlamaConfig,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
    )

    classes = {"llama": LlamaConfig, "qwen35": Qwen3_5TextConfig, "gemma4": Gemma4TextConfig}
    classes["qwen35moe"], classes["laguna"] = Qwen3_5MoeTextConfig, LagunaConfig
    config_cls = classes[kind]
    names = ("<bos>", "<eos>") if kind == "gemma4" else (SPECIALS[0], SPECIALS[2])
    bos, eos = (tok.token_to_id(s) for s in names)
    vocab = tok.get_vocab_size() if kind == "gemma4" else VOCAB
    if kind == "gemma4":
        spec = {**spec, "vocab_size_per_layer_input": vocab, "pad_token_id": None}
    # no pad_token_id: it would zero the BOS embedding row and flatten position 0
    config = config_cls(
        vocab_size=vocab,
        initializer_range=INIT_STD,
        max_position_embeddings=2048,
        bos_token_id=bos,
        eos_token_id=eos,
        **spec,
    )
    arch = {"llama": "LlamaForCausalLM", "qwen35": "Qwen3_5ForCausalLM"}
    arch["qwen35moe"], arch["laguna"] = "Qwen3_5MoeForCausalLM", "LagunaForCausalLM"
    config.architectures = [arch.get(kind, "Gemma4ForCausalLM")]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            # off-unit norms and dt biases, so a converter or loader that drops them shows
            if p.ndim == 1 and not name.endswith("A_log"):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    model.to(torch.bfloat16)  # round as a bf16 checkpoint stores the weights
    std = logit_std(model.float(), tok)  # in place; the values stay bf16-exact
    model.to(torch.bfloat16).save_pretrained(out)
    return std


def logit_std(model, tok) -> float:
    import torch

    ids = torch.tensor([tok.encode(SAMPLE).ids[:40]])
    with torch.no_grad():
        logits = model(ids).logits[0]
    return float(logits.std(dim=-1).min())


def add_mtp(out: Path, seed: int) -> list[str]:
    """Add one MTP block under the names Qwen3.5 releases use and the converter maps.

    ``conversion/qwen.py`` (_QwenMtpMixin) renames ``mtp.fc`` -> ``eh_proj``,
    ``mtp.pre_fc_norm_{embedding,hidden}`` -> ``enorm``/``hnorm``, ``mtp.norm`` ->
    ``shared_head.norm`` and ``mtp.layers.0.*`` -> layer ``n_layer`` (a full-attention block; in
    the MoE model its MLP is a MoE block like the trunk's: router, experts, shared expert).
    """
    import torch
    from safetensors.torch import load_file, save_file

    path, cfg_path = out / "model.safetensors", out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    weights, h = load_file(path), cfg["hidden_size"]
    full = cfg["layer_types"].index("full_attention")
    gen = torch.Generator().manual_seed(seed)

    def rand(shape: tuple) -> torch.Tensor:
        scale = 0.1 if len(shape) == 1 else INIT_STD  # 1-D: offsets of (1 + w) norms
        return (scale * torch.randn(shape, generator=gen)).to(torch.bfloat16)

    src = f"model.layers.{full}."
    block = {k.removeprefix(src): v for k, v in weights.items() if k.startswith(src)}
    mtp = {f"mtp.layers.0.{k}": rand(v.shape) for k, v in block.items()}
    mtp["mtp.fc.weight"] = rand((h, 2 * h))  # input is [embedding ; hidden]
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{norm}.weight"] = rand((h,))
    save_file({**weights, **dict(sorted(mtp.items()))}, path, metadata={"format": "pt"})
    cfg.update(mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return sorted(mtp)


# --- conversion ------------------------------------------------------------------------------


def converter_root(sdist: Path | None, tmp: Path) -> Path:
    """Extract the converter, its ``conversion`` package and ``gguf-py`` from the sdist."""
    if sdist is None:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*cmd, f"llama-cpp-python=={PIN}", "-d", str(tmp)], check=True)
        sdist = next(tmp.glob(f"llama_cpp_python-{PIN}.tar.gz"))
    top = f"llama_cpp_python-{PIN}/vendor/llama.cpp/"
    wanted = (top + "convert_hf_to_gguf.py", top + "conversion/", top + "gguf-py/")
    with tarfile.open(sdist) as tf:
        members = [m for m in tf.getmembers() if m.name.startswith(wanted)]
        if not members:
            raise SystemExit(f"{sdist}: no {top} inside; pass the llama-cpp-python {PIN} sdist")
        tf.extractall(tmp, members=members, filter="data")
    return tmp / top


def convert(root: Path, hf_dir: Path, out: Path, outtype: str, extra: tuple = ()) -> None:
    cmd = [sys.executable, "-c", _CONVERT, str(root), PRE_TOKENIZER, str(hf_dir)]
    cmd += ["--outtype", outtype, "--outfile", str(out), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"converting {hf_dir.name} to {outtype} failed (log above)")
    print(f"  {out.name}: {out.stat().st_size} bytes", flush=True)


def build_all(
    outdir: Path, sdist: Path | None, seed: int, keep_hf: Path | None, only: set[str] | None
) -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hf-fixtures-") as tmp_name:
        tmp = Path(tmp_name)
        root = converter_root(sdist, tmp / "sdist")
        hf = keep_hf or tmp / "hf"
        tok = train_tokenizer()
        corpus_sha = hashlib.sha256("\n".join(corpus()).encode()).hexdigest()[:16]
        print(f"tokenizer: {tok.get_vocab_size()} tokens, corpus sha256 {corpus_sha}")
        # (checkpoint, transformers kind, spec, add BOS, [(fixture prefix, converter flags)])
        plan = [
            ("llama-tied", "llama", LLAMA_TIED, True, [("llama-tied", ())]),
            ("llama-untied", "llama", LLAMA_UNTIED, True, [("llama-untied", ())]),
            ("qwen35", "qwen35", QWEN35, False, [("qwen35", ("--no-mtp",)), ("qwen35-mtp", ())]),
            ("gemma4", "gemma4", GEMMA4, True, [("gemma4", ())]),
            ("gemma4-moe", "gemma4", GEMMA4_MOE, True, [("gemma4-moe", ())]),
            # last, so the seeds (from the index) of the ones above stay as they were
            (
                "qwen35moe",
                "qwen35moe",
                QWEN35MOE,
                False,
                [("qwen35moe", ("--no-mtp",)), ("qwen35moe-mtp", ())],
            ),
            ("laguna-xs", "laguna", LAGUNA_XS, False, [("laguna-xs", ())]),
            ("laguna-m", "laguna", LAGUNA_M, False, [("laguna-m", ())]),
        ]
        gemma_tok = gemma_tokenizer()
        for i, (name, kind, spec, add_bos, outputs) in enumerate(plan):
            if only and name not in only:
                continue
            ckpt = hf / name
            ckpt.mkdir(parents=True, exist_ok=True)
            if kind == "gemma4":
                write_gemma_tokenizer(gemma_tok, ckpt)
            else:
                write_tokenizer(tok, ckpt, add_bos)  # first: the std below sees BOS when added
            model_tok = gemma_tok if kind == "gemma4" else tok
            std = build_checkpoint(ckpt, kind, spec, model_tok, seed * 100 + i)
            if std < MIN_LOGIT_STD:
                raise SystemExit(f"{name}: logit std {std:.3f} < {MIN_LOGIT_STD}; raise INIT_STD")
            if kind in ("qwen35", "qwen35moe"):
                print(f"  added {len(add_mtp(ckpt, seed * 100 + 50 + i))} mtp.* tensors")
            print(f"{name}: HF logit std (min over positions) {std:.3f}", flush=True)
            for prefix, flags in outputs:
                for outtype in CONVERT_TYPES:
                    convert(root, ckpt, outdir / f"{prefix}-{outtype}.gguf", outtype, flags)


# --- quantize and check (the interpreter with llama_cpp and lucepy) --------------------------


def quantize_all(outdir: Path) -> None:
    from lucepy.testing.quantize import quantize

    for src in sorted(outdir.glob("*-f32.gguf")):
        for suffix, ftype in QUANT_TYPES.items():
            dst = quantize(
                src, src.with_name(src.name.replace("-f32.gguf", f"-{suffix}.gguf")), ftype
            )
            print(f"  {dst.name}: {dst.stat().st_size} bytes  {type_counts(dst)}", flush=True)
    for path in sorted(outdir.glob("*.gguf")):
        if path.stem not in COMMITTED:
            path.unlink()


def type_counts(path: Path) -> str:
    from collections import Counter

    from lucepy.gguf import GGUFFile

    with GGUFFile(path) as f:
        counts = Counter(t.type.name for t in f.tensors.values())
    return " ".join(f"{k}:{v}" for k, v in sorted(counts.items()))


def check_one(path: Path) -> tuple[bool, str]:
    """Load in lucepy's reader and in llama.cpp; logits must be finite and spread per position."""
    import numpy as np
    from llama_cpp import Llama

    from lucepy.gguf import GGUFFile

    with GGUFFile(path) as f:
        arch, n_tensors = f.architecture, len(f.tensors)
    llm = Llama(model_path=str(path), n_ctx=256, logits_all=True, flash_attn=True, verbose=False)
    try:
        tokens = llm.tokenize(SAMPLE.encode(), add_bos=True)[:40]
        llm.eval(tokens)
        logits = np.asarray(llm.scores[: len(tokens)], dtype=np.float64)
    finally:
        llm.close()
    std = logits.std(axis=-1)
    ok = bool(np.isfinite(logits).all() and std.min() > 0.1)
    line = f"{arch} {n_tensors} tensors, {len(tokens)} tokens, logit std min {std.min():.3f}"
    return ok, line + f" mean {std.mean():.3f}"


def check_all(outdir: Path) -> int:
    paths = sorted(outdir.glob("*.gguf"))
    bad = 0
    for path in paths:
        ok, line = check_one(path)
        bad += not ok
        print(f"{'ok ' if ok else 'BAD'} {path.name:28s} {path.stat().st_size:>9d} B  {line}")
    total = sum(p.stat().st_size for p in paths)
    print(f"{len(paths)} files, {total} bytes, {bad} failed")
    return 1 if bad or not paths else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--sdist", type=Path, help=f"llama_cpp_python-{PIN}.tar.gz (else pip download)")
    ap.add_argument("--stage", choices=("all", "build", "quantize", "check"), default="all")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-hf", type=Path, help="keep the HF checkpoints in this folder")
    ap.add_argument("--only", nargs="+", help="build only these checkpoints (e.g. gemma4)")
    ap.add_argument("--llama-python", default="python3", help="interpreter with llama_cpp, lucepy")
    args = ap.parse_args(argv)
    if args.stage in ("all", "build"):
        only = set(args.only) if args.only else None
        build_all(args.outdir, args.sdist, args.seed, args.keep_hf, only)
    if args.stage == "all":
        for stage in ("quantize", "check"):
            cmd = [args.llama_python, __file__, str(args.outdir), "--stage", stage]
            if subprocess.run(cmd).returncode != 0:
                return 1
    elif args.stage == "quantize":
        quantize_all(args.outdir)
    elif args.stage == "check":
        return check_all(args.outdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Write a trained DFlash draft as a GGUF of the pinned llama.cpp's ``dflash`` architecture.

The weights are numpy arrays named as in the GGUF, outermost dimension first (a linear layer is
[out, in]). The draft shares the target's embedding and head, so it carries neither; it does carry
the target's vocabulary, which llama.cpp checks, and the mask token. No torch here:
tools/train_dflash.py calls ``write`` on the GPU machine, and ``python3 tools/dflash_gguf.py
WEIGHTS.npz... --target T.gguf --out D.gguf`` re-writes a draft from its saved weights.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).parents[1]))  # the repo, also where lucepy is not installed
from lucepy.testing.tiny_draft import DRAFT_HPARAMS, draft_writer  # noqa: E402

QUANTS = ("q8_0", "q5_1", "q5_0", "q4_0")  # what gguf-py quantizes
QUANTIZABLE = ("fc", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@dataclass(frozen=True)
class DraftConfig:
    n_layer: int = 3
    n_embd: int = 576  # the target's: the draft reads its embedding
    n_head: int = 9
    n_head_kv: int = 3
    head_dim: int = 64
    n_ff: int = 1536
    target_layers: tuple[int, ...] = (2, 8, 15, 22, 28)  # the residual entering these layers
    block_size: int = 16
    mask_token: int = 16  # SmolLM2's <empty_output>, which a chat never holds
    rope_theta: float = 100000.0
    rms_eps: float = 1e-5
    context_length: int = 8192


TOKENIZER_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_space_prefix",
)


def _copy_tokenizer(w: gguf.GGUFWriter, target: Path) -> None:
    r = gguf.GGUFReader(str(target))
    for key in TOKENIZER_KEYS:
        field = r.get_field(key)
        if field is None:
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, list(field.contents()))
        else:
            w.add_key_value(key, field.contents(), vtype)


def _tensor(
    name: str, values: np.ndarray, qtype: str
) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
    """Matrices (fc too) in ``qtype`` (QUANTS, f16 or f32), vectors (norms) in f32."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if values.ndim == 2 and name.split(".")[-2] in QUANTIZABLE:
        if qtype in QUANTS:
            kind = gguf.GGMLQuantizationType[qtype.upper()]
            return gguf.quants.quantize(values, kind), kind
        if qtype == "f16":
            return values.astype(np.float16), gguf.GGMLQuantizationType.F16
    return values, gguf.GGMLQuantizationType.F32


def write(
    path: Path, weights: dict[str, np.ndarray], cfg: DraftConfig, target: Path, qtype: str = "q5_1"
) -> Path:
    w = draft_writer(
        path,
        "SmolLM2-135M-Instruct DFlash draft (lucepy)",
        context_length=cfg.context_length,
        n_embd=cfg.n_embd,
        rms_eps=cfg.rms_eps,
        **{k: getattr(cfg, k) for k in DRAFT_HPARAMS},
    )
    _copy_tokenizer(w, target)
    w.add_uint32("tokenizer.ggml.mask_token_id", cfg.mask_token)
    for name in sorted(weights):
        data, kind = _tensor(name, weights[name], qtype)
        w.add_tensor(name, data, raw_dtype=kind if kind != gguf.GGMLQuantizationType.F32 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def load_npz(paths: list[Path]) -> tuple[dict[str, np.ndarray], DraftConfig]:
    """Weights saved in parts by tools/train_dflash.py, with the config in each part."""
    weights, cfg = {}, None
    for p in paths:
        with np.load(p) as z:
            for name in z.files:
                if name == "config":
                    cfg = json.loads(str(z[name]))
                else:
                    weights[name] = z[name]
    if cfg is None:
        raise SystemExit(f"{paths}: no config saved with the weights")
    cfg["target_layers"] = tuple(cfg["target_layers"])
    return weights, DraftConfig(**cfg)


def config_json(cfg: DraftConfig) -> str:
    return json.dumps(asdict(cfg))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("weights", nargs="+", type=Path, help="the .npz parts train_dflash saved")
    ap.add_argument("--target", type=Path, required=True, help="the target GGUF (its vocabulary)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--type", choices=(*QUANTS, "f16", "f32"), default="q5_1")
    args = ap.parse_args()
    weights, cfg = load_npz(args.weights)
    write(args.out, weights, cfg, args.target, args.type)
    print(f"{args.out}: {args.out.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()

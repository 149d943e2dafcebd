"""tools/trace_gpu.py's share of the span by kernel (``critical``) and its decode-against-verify
table (``path``), on made-up kernel timelines: no GPU needed."""

from __future__ import annotations

import pytest
from tool_scripts import load_tool

trace_gpu = load_tool("trace_gpu")


def shares(calls):
    return {r["kernel"]: (r["us"], r["per_call"]) for r in trace_gpu.critical(calls)}


def test_a_kernel_launched_early_counts_only_what_it_adds_and_gaps_count_to_none():
    # norm runs 0-4; gemm starts early at 1 (waiting inside) and ends at 20; sum starts after an
    # idle gap at 22 and ends at 25; a kernel wholly inside gemm's time adds nothing
    call = [("norm", 0.0, 4.0), ("gemm", 1.0, 20.0), ("inside", 5.0, 9.0), ("sum", 22.0, 25.0)]
    got = shares([call, list(reversed(call))])  # (start order is the kernels' own)
    assert got == {
        "norm": (4.0, 1),
        "gemm": (16.0, 1),
        "inside": (0.0, 1),
        "sum": (3.0, 1),
        "idle": (2.0, 0),
    }
    assert sum(us for us, _ in got.values()) == pytest.approx(25.0)  # the span


def test_the_path_tables_put_what_the_verify_adds_first_by_role_and_by_kernel():
    decode = [  # (a product launched once a step is the output head; the others more often)
        ("lucepy::gemv_r<8>", 0.0, 4.0),
        ("lucepy::gemv_r<8>", 4.0, 10.0),
        ("lucepy::norm_quantize", 10.0, 12.0),
        ("lucepy::gemv<3>", 12.0, 20.0),  # launched once: the output head
    ]
    verify = [
        ("lucepy::gemm_r<2>", 0.0, 7.0),
        ("lucepy::gemm_sum", 7.0, 7.5),
        ("lucepy::gemm_r<2>", 7.5, 15.0),
        ("lucepy::gemm_sum", 15.0, 16.0),
        ("lucepy::sum_norm_halves<5>", 16.0, 18.0),
        ("lucepy::gemm<3>", 18.0, 27.0),
        ("lucepy::delta_net_layers", 30.0, 31.5),  # after the host's gap
    ]
    table = trace_gpu.path(
        {"critical_path": trace_gpu.critical([decode])},
        {"critical_path": trace_gpu.critical([verify])},
    )
    assert table.startswith("Share of the span, us a call: a decode 20.0, a verify 31.5")
    roles = [line for line in table.splitlines() if line.startswith("| ") and "`" not in line]
    assert roles[1:-1] == [
        "| products, their parts' sums and the FFN gate | 10.0 | 16.0 | +6.0 |",
        "| idle (between kernels: the host) | 0.0 | 3.0 | +3.0 |",
        "| the rollback's recurrences | 0.0 | 1.5 | +1.5 |",
        "| the output head and its argmax | 8.0 | 9.0 | +1.0 |",
        "| residual sums and norms, the products' activations | 2.0 | 2.0 | +0.0 |",
    ]
    kernels = [line.split("|")[1].strip() for line in table.splitlines() if "| `" in line]
    assert kernels[:2] == ["`lucepy::gemm_r<2>`", "`lucepy::gemm<3>`"]
    assert kernels[-1] == "`lucepy::gemv_r<8>`"
    assert "| `lucepy::gemv<3>` | 8.0 (1) | 0.0 (0) | -8.0 |" in table
    assert "| `lucepy::gemm_r<2>` | 0.0 (0) | 14.5 (2) | +14.5 |" in table


@pytest.mark.parametrize(
    "verify_product",
    ["lucepy::gemm_rb<2, 5, 0, lucepy::RpQ4_0>", "lucepy::gemm_f8<2, 5, 2, lucepy::RpQ4_0>"],
)
def test_the_layers_table_times_each_part_of_a_layer_from_its_start_to_the_next(verify_product):
    # two DeltaNet layers and an attention layer, then the head; each part from its first
    # kernel's start to the next part's (a product launched early waits inside its part), the
    # products' sums (a verify's) or the norms after them (a decode's) inside their part, a
    # rollback after the head; written by ``sequence`` as a trace's calls are
    def call(product, inside, scale):
        kernels, t = [("k_get_rows<32>", 0.0, 1.0)], 2.0
        for kind in ("dn", "dn", "attn"):
            parts = [(product, 10), ("lucepy::conv_step<4>", 3), ("lucepy::delta_net", 2)]
            if kind == "attn":
                parts = [(product, 9), ("lucepy::norm_rope", 5)]
            for name, us in parts + [(product, 8), (product, 20), (product, 12)]:
                kernels.append((name, t, t + us * scale))
                if name == product:
                    kernels.append((inside, t + us * scale - 1.0, t + us * scale))
                t += us * scale
        kernels.append((product + " head", t, t + 50.0 * scale))
        end = t + 50.0 * scale + (30.0 if inside == "lucepy::gemm_sum" else 1.0)
        if inside == "lucepy::gemm_sum":  # the rollback, after the host's gap
            kernels += [("lucepy::delta_net_layers", end - 10.0 + k, end - 9.0 + k) for k in (0, 1)]
            kernels.append(("lucepy::delta_net_layers", end - 8.0, end))
        else:
            kernels.append(("lucepy::argmax_rows", end - 1.0, end))
        return trace_gpu.sequence([kernels] * 3)

    decode = call("lucepy::gemv_r<8, 1, false, lucepy::RpQ4_0>", "lucepy::norm_quantize", 1.0)
    verify = call(verify_product, "lucepy::gemm_sum", 1.5)
    table = trace_gpu.layers(decode, verify)
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    ours = verify_product.split("<")[0].removeprefix("lucepy::")  # (gemm_f8: session 55)
    assert rows[1:] == [
        row.replace("gemm_rb", ours)
        for row in [
            "| DeltaNet (2) | gemv_r / gemm_rb | 10.0 | 15.0 | +5.0 |",
            "| DeltaNet (2) | conv_step | 3.0 | 4.5 | +1.5 |",
            "| DeltaNet (2) | delta_net | 2.0 | 3.0 | +1.0 |",
            "| DeltaNet (2) | gemv_r / gemm_rb | 8.0 | 12.0 | +4.0 |",
            "| DeltaNet (2) | gemv_r / gemm_rb | 20.0 | 30.0 | +10.0 |",
            "| DeltaNet (2) | gemv_r / gemm_rb | 12.0 | 18.0 | +6.0 |",
            "| DeltaNet (2) | the whole layer | 55.0 | 82.5 | +27.5 |",
            "| attention (1) | gemv_r / gemm_rb | 9.0 | 13.5 | +4.5 |",
            "| attention (1) | norm_rope | 5.0 | 7.5 | +2.5 |",
            "| attention (1) | gemv_r / gemm_rb | 8.0 | 12.0 | +4.0 |",
            "| attention (1) | gemv_r / gemm_rb | 20.0 | 30.0 | +10.0 |",
            "| attention (1) | gemv_r / gemm_rb | 12.0 | 18.0 | +6.0 |",
            "| attention (1) | the whole layer | 54.0 | 81.0 | +27.0 |",
            "| | the output head | 50.0 | 75.0 | +25.0 |",
            "| | after the head (argmax, host gap, rollback) | 1.0 | 30.0 | +29.0 |",
        ]
    ]

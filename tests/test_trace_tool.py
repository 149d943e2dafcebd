"""tools/trace_gpu.py's share of the span by kernel (``critical``) and its decode-against-verify
table (``path``), on made-up kernel timelines: no GPU needed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "trace_gpu", Path(__file__).parent.parent / "tools" / "trace_gpu.py"
)
trace_gpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(trace_gpu)


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

"""A graph's host-written inputs (runtime/graphs.py, InputBlock): one buffer, one copy a step."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import THREADS

from lucepy.ggml import ffi
from lucepy.runtime.config import RuntimeConfig
from lucepy.runtime.engine import Engine


def test_step_inputs_land_in_the_graphs_input_buffer_and_are_checked(tiny_model):
    with Engine(tiny_model("base", "f32"), RuntimeConfig(threads=THREADS, max_ctx=256)) as e:
        e.prefill([1, 2, 3, 4])
        e.decode(7)
        [g] = [g for s, g in e.shard.graphs.items() if s.n_tokens == 1]
        step, constants = g.blocks
        assert {"tokens", "pos", "mask", "rows"} <= set(step.arrays)
        assert "x" not in step.arrays  # carried inputs stay in the compute buffer
        lib = e.lib
        for name in ("tokens", "pos", "rows"):
            t = g.inputs[name]
            got = np.empty(step.arrays[name].size, dtype=step.arrays[name].dtype)
            lib.ggml_backend_tensor_get(t, ffi.from_buffer(got), 0, got.nbytes)
            np.testing.assert_array_equal(got, step.arrays[name])
        assert int(step.arrays["tokens"][0]) == 7
        assert int(step.arrays["rows"][0]) == 4  # the fifth position's cache row
        with pytest.raises(ValueError, match="takes"):
            g.write_inputs({"pos": np.zeros(1, dtype=np.int64)})
        with pytest.raises(ValueError, match="takes"):
            g.write_inputs({"tokens": np.zeros(2, dtype=np.int32)})

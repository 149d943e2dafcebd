"""lucepy's own CUDA kernels (issue 19), the parts a machine without a GPU can check: the piece
math of vendor/ggml/cuda/lucepy-quants.cuh, compiled for the host, against ggml's own values of
the same blocks; the patch that hooks the kernels into ggml, applied and taken back strictly; the
recipe and the CLI. tests/test_gpu_kernels.py runs the kernels themselves."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lucepy.errors import BuildError, ConfigError
from lucepy.ggml import load
from lucepy.runtime import backends
from lucepy.testing.quants import KINDS, dequantize, quantize, quantize_activations

HERE = Path(__file__).parent
KERNELS = backends.VENDOR / "cuda"


def host_build(tmp: Path, name: str) -> Path:
    """tests/cuda/NAME.cpp built with the host's C++ compiler."""
    compiler = shutil.which("c++") or shutil.which("g++")
    assert compiler, "a C++ compiler is needed (the CPU build of ggml needs one too)"
    exe = tmp / name
    cmd = [compiler, "-std=c++17", "-O1", f"-I{KERNELS}", str(HERE / "cuda" / f"{name}.cpp")]
    subprocess.run([*cmd, "-o", str(exe)], check=True)
    return exe


@pytest.fixture(scope="module")
def host_check(tmp_path_factory) -> Path:
    return host_build(tmp_path_factory.mktemp("quants"), "quants_host")


def test_a_product_splits_into_parts_as_its_rows_allow(tmp_path):
    """gemm_parts (lucepy-plan.h, gemm's): a product of few row tiles takes the most parts that
    still run in one wave of CTAs (qwen35's 96-row DeltaNet alpha and beta once took one, and 26
    us a 16-column product); one of many rows the fewest whose last wave is fullest; never more
    than gemm_max_parts (each part at least 2 chunks, at most 16 parts). gemm_parts_by_cost
    (gemm_r's) never leaves a part without chunks, takes the most for few row tiles as well, and
    the counts measured fastest on the H200 at 16 columns (docs/BENCHMARKS.md, session 29)."""
    exe = host_build(tmp_path, "plan_host")
    slots = 528  # the H200's: 4 CTAs of 64 rows a multiprocessor, 132 of them
    shapes = [  # (rows, pieces): the 27B-shaped model's products, tiny ones, odd ones
        (96, 160), (128, 160), (64, 16), (64, 2), (1024, 160), (5120, 544), (5120, 192),
        (10240, 160), (17408, 160), (34816, 160), (1000, 37), (248320, 160),
    ]  # fmt: skip
    got = plans(exe, [(r, p, slots, 0.35) for r, p in shapes])
    assert len(got) == len(shapes)
    for (rows, pieces), (parts, most, by_cost) in zip(shapes, got, strict=True):
        tiles = -(-rows // 64)
        chunks = -(-pieces // 8)
        assert most == max(1, min(16, chunks // 2)), (rows, pieces)
        assert 1 <= parts <= most and 1 <= by_cost <= most, (rows, pieces, parts, by_cost)
        assert -(-chunks // -(-chunks // by_cost)) == by_cost, (rows, pieces, by_cost)  # none empty
        one_wave = [p for p in range(1, most + 1) if tiles * p <= slots]
        if one_wave and one_wave[-1] == most:
            assert parts == most, (rows, pieces, parts)  # all in one wave: the most
        elif one_wave:
            assert parts >= one_wave[-1], (rows, pieces, parts)  # never fewer than one wave's
    by_cost = {shape: row[2] for shape, row in zip(shapes, got, strict=True)}
    assert got[0][:2] == (10, 10) and by_cost[(96, 160)] == 10  # the alpha and beta: 10 parts of 2
    assert by_cost[(1024, 160)] == 10
    # measured (us, 16 columns): the FFN's up and gate as one product 44.8 in 5 parts against
    # 51.2 in gemm_parts' 10; the up alone 25.3 in 5 against 26.2 in 9; the down 23.9 in 6
    # against 24.8 in 13
    assert by_cost[(34816, 160)] == 5 and by_cost[(17408, 160)] == 5
    assert by_cost[(5120, 544)] == 6


def test_a_short_last_wave_is_cut_into_parts(tmp_path):
    """tail_plan (lucepy-plan.h: gemm_f8's one-part products, lucepy-f8.cuh's F8Tail): the row
    tiles past the last whole wave of one CTA an SM, where they are at most half the SMs, each
    cut along k into as many parts as the SMs take one each of (at most `most`, 2 chunks a part
    and more, none empty), every CTA fitting at once; else no tail. The 27B-shaped FFN stack at
    16 columns on an H200 (544 tiles of 20 chunks, 132 SMs, 660 slots): 7 parts of 3 chunks
    each of the 16 tiles past 4 waves."""
    exe = host_build(tmp_path, "tail_host")
    cases = {  # (tiles, chunks, SMs, slots, most): (from, parts, chunks, CTAs)
        (544, 20, 132, 660, 8): (528, 7, 3, 640),
        (544, 20, 132, 660, 4): (528, 4, 5, 592),
        (544, 4, 132, 660, 8): (528, 2, 2, 560),
        (140, 20, 132, 660, 8): (132, 7, 3, 188),
        (528, 20, 132, 660, 8): (528, 0, 0, 528),  # whole waves
        (100, 20, 132, 660, 8): (100, 0, 0, 100),  # under one wave
        (600, 20, 132, 660, 8): (600, 0, 0, 600),  # 72 past: more than half the SMs
        (544, 20, 132, 600, 8): (544, 0, 0, 544),  # 640 CTAs: more than fit at once
        (544, 20, 132, 660, 0): (544, 0, 0, 544),
        (544, 3, 132, 660, 8): (544, 0, 0, 544),  # 3 chunks: no 2 parts of 2
    }
    rng = np.random.default_rng(5)
    free = [
        (int(rng.integers(1, 2000)), int(rng.integers(1, 80)), int(rng.integers(1, 200)), 0, 8)
        for _ in range(300)
    ]
    free = [(t, c, s, int(rng.integers(s, 6 * s + 1)), m) for t, c, s, _, m in free]
    shapes = list(cases) + free
    lines = "".join(" ".join(map(str, shape)) + "\n" for shape in shapes)
    out = subprocess.run([exe], input=lines, capture_output=True, text=True, check=True).stdout
    got = [tuple(map(int, line.split())) for line in out.splitlines()]
    assert got[: len(cases)] == list(cases.values())
    for (tiles, chunks, sms, slots, most), (start, parts, per, ctas) in zip(
        shapes, got, strict=True
    ):
        rest = tiles - start
        if parts == 0:
            assert (start, per, ctas) == (tiles, 0, tiles)
            continue
        assert start == tiles // sms * sms and 0 < rest <= sms // 2, (tiles, sms, start)
        assert 2 <= parts <= most and rest * parts <= sms, (tiles, sms, parts)
        assert per >= 2 and (parts - 1) * per < chunks <= parts * per  # none empty
        assert ctas == start + rest * parts <= slots


def plans(exe: Path, shapes: list[tuple[int, int, int, float]]) -> list[tuple[int, ...]]:
    """plan_host's (parts, most, by_cost) for each (rows, pieces, slots, start) at 16 columns."""
    lines = "".join(f"{r} {p} 64 8 {slots} 16 {start}\n" for r, p, slots, start in shapes)
    out = subprocess.run([exe], input=lines, capture_output=True, text=True, check=True).stdout
    return [tuple(map(int, line.split())) for line in out.splitlines()]


def test_gemm_f8s_longer_start_keeps_its_products_in_one_wave(tmp_path):
    """gemm_f8's plan (GemmF8::start, 2 chunks a CTA's start where gemm_r's is 0.35) at its 5
    CTAs an SM on the H200 (660 slots): the 27B-shaped DeltaNet inputs (16,480 rows) in the 2
    parts measured fastest at 16 columns (19.8 us, where the 5 that gemm_r's start picks took
    22.1: docs/BENCHMARKS.md, session 54), ffn down in the 8 of one wave, the FFN's stack whole."""
    exe = host_build(tmp_path, "plan_host")
    shapes = [(16480, 160), (5120, 544), (34816, 160)]
    f8 = [row[2] for row in plans(exe, [(r, p, 660, 2.0) for r, p in shapes])]
    r = [row[2] for row in plans(exe, [(r, p, 660, 0.35) for r, p in shapes])]
    assert f8 == [2, 8, 1]
    assert r[0] == 5  # (the start is what moves it)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_pieces_equal_ggml_values(kind, host_check):
    """Each 32-value piece of each row, unpacked by the kernels' code, times int8 activations,
    equals ggml's dequantized values times the same activations (to f32 rounding). The
    activations' sum is given exactly, so Q4_K's mins are checked as well."""
    lib = load()
    gtype, number = KINDS[kind]
    rng = np.random.default_rng(19)
    rows, n = 5, 1024
    weights = rng.normal(size=(rows, n)) * rng.uniform(0.1, 3.0, size=(rows, 1))
    weights[1, :300] += 2.0  # a row part with an offset: nonzero Q4_K mins
    raw = quantize(lib, weights, gtype)
    exact = dequantize(lib, raw, gtype, n).astype(np.float64)
    x = rng.normal(size=n).astype(np.float32)
    x[64:96] = 0.0  # an all-zero piece
    xq, d = quantize_activations(x)
    xs = xq.astype(np.float64) * d[:, None].astype(np.float64)
    sums = xs.sum(axis=1).astype(np.float32)
    ds = np.stack([d, sums], axis=1).astype(np.float32)
    head = np.array([number, rows, n // 32], dtype=np.int32)
    run = subprocess.run(
        [str(host_check)],
        input=head.tobytes() + raw.tobytes() + xq.tobytes() + ds.tobytes(),
        capture_output=True,
        check=True,
    )
    ours = np.frombuffer(run.stdout, dtype=np.float32).reshape(rows, n // 32)
    products = exact.reshape(rows, n // 32, 32) * xs[None]
    want = products.sum(axis=-1)
    scale = np.abs(products).sum(axis=-1)
    assert np.abs(want).max() > 1.0  # the data is not degenerate
    np.testing.assert_array_less(np.abs(ours - want), 1e-5 * scale + 1e-30)
    assert np.all(ours[:, 2] == 0.0)  # the zero piece


def _pinned_twin(root: Path) -> backends.Kernels:
    """A source tree whose patched files hold exactly the lines hooks.patch expects (filler
    elsewhere), and the kernel spec with their hashes before and after patching."""
    text = (KERNELS / "hooks.patch").read_text()
    hashes = {}
    for rel, hunks in backends.parse_patch(text).items():
        lines: list[str] = []
        for old_start, old, _, _ in hunks:
            lines += [f"// line {i}" for i in range(len(lines), old_start - 1)]
            lines += old
        lines.append("// end")
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines))
        hashes[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    spec = backends.plan_build("cuda").kernels
    twin = root.parent / "twin"
    shutil.copytree(root, twin)
    backends.apply_patch(twin, text)
    sha = {
        rel: (h, hashlib.sha256((twin / rel).read_bytes()).hexdigest()) for rel, h in hashes.items()
    }
    return backends.Kernels(spec.dir, spec.files, spec.patch, sha)


def test_the_patch_hooks_and_unhooks_the_pinned_files_only(tmp_path):
    src = tmp_path / "src"
    kernels = _pinned_twin(src)
    target = src / kernels.dir

    def state():
        return {rel: hashlib.sha256((src / rel).read_bytes()).hexdigest() for rel in kernels.sha256}

    pinned = {rel: pair[0] for rel, pair in kernels.sha256.items()}
    patched = {rel: pair[1] for rel, pair in kernels.sha256.items()}
    assert pinned != patched
    backends.hook_kernels(src, kernels, True)
    assert state() == patched
    assert sorted(p.name for p in target.glob("lucepy-*")) == sorted(f.name for f in kernels.files)
    text = (target / "ggml-cuda.cu").read_text()
    assert text.count("lucepy_cuda_mul_mat(") == 1 and text.count("lucepy_cuda_graph_begin(") == 1
    assert (target / "mmvq.cu").read_text().count("lucepy_cuda_mul_mat(") == 1
    backends.hook_kernels(src, kernels, True)  # a kept tree, patched already
    assert state() == patched
    backends.hook_kernels(src, kernels, False)
    assert state() == pinned and not list(target.glob("lucepy-*"))

    (target / "mmvq.cu").write_text((target / "mmvq.cu").read_text() + "\n// not pinned\n")
    with pytest.raises(BuildError, match="not the pinned ggml's.*--kernels ggml"):
        backends.hook_kernels(src, kernels, True)
    backends.hook_kernels(src, kernels, False)  # ggml's kernels build from any source


def test_a_kept_tree_gets_a_changed_kernel_file_stamped_now_and_keeps_the_others(tmp_path):
    """A kernel file edited while a build ran carries a time older than the object built from
    the tree's last copy: copied with its own time, ninja kept the stale object."""
    spec = _pinned_twin(tmp_path / "src")
    own = tmp_path / "own"
    own.mkdir()
    files = [Path(shutil.copy2(f, own / f.name)) for f in spec.files]
    kernels = backends.Kernels(spec.dir, files, spec.patch, spec.sha256)
    src, target = tmp_path / "src", tmp_path / "src" / spec.dir
    backends.hook_kernels(src, kernels, True)
    old = time.time() - 3600
    for f in files:
        os.utime(target / f.name, (old, old))
    changed, kept = files[0], files[1]
    changed.write_text(changed.read_text() + "\n// edited\n")
    os.utime(changed, (old - 60, old - 60))  # (older than the tree's copy)
    before = time.time()
    backends.hook_kernels(src, kernels, True)
    assert (target / changed.name).read_text() == changed.read_text()
    assert (target / changed.name).stat().st_mtime >= before - 1
    assert (target / kept.name).stat().st_mtime == pytest.approx(old)


def test_a_patch_applies_only_where_its_context_matches(tmp_path):
    (tmp_path / "f.c").write_text("a\nb\nc\nd\n")
    patch = "--- a/f.c\n+++ b/f.c\n@@ -2,2 +2,3 @@\n b\n+x\n c\n"
    backends.apply_patch(tmp_path, patch)
    assert (tmp_path / "f.c").read_text() == "a\nb\nx\nc\nd\n"
    backends.apply_patch(tmp_path, patch, reverse=True)
    assert (tmp_path / "f.c").read_text() == "a\nb\nc\nd\n"
    (tmp_path / "f.c").write_text("a\nB\nc\nd\n")
    with pytest.raises(BuildError, match="does not match at line 2"):
        backends.apply_patch(tmp_path, patch)


def test_cuda_builds_hook_lucepys_kernels_unless_asked_not_to():
    ours = backends.plan_build("cuda", arch="90")
    assert ours.own and ours.which_kernels == "lucepy" and ours.prefix.name == "cuda"
    assert all(f.exists() for f in (*ours.kernels.files, ours.kernels.patch))
    # and every kernel file beside them is listed (an unlisted header would be missing from the
    # source tree the build compiles)
    here = ours.kernels.patch.parent
    assert {f.name for f in here.glob("lucepy-*")} == {f.name for f in ours.kernels.files}
    for pinned, patched in ours.kernels.sha256.values():
        assert len(pinned) == len(patched) == 64 and pinned != patched
    plain = backends.plan_build("cuda", kernels="ggml")
    assert not plain.own and plain.prefix.name == "cuda-ggml" and plain.kernels is not None
    assert backends.plan_build("cpu").which_kernels == "ggml"
    with pytest.raises(ConfigError, match="no kernels of its own for cpu"):
        backends.plan_build("cpu", kernels="lucepy")
    with pytest.raises(ConfigError, match="use lucepy or ggml"):
        backends.plan_build("cuda", kernels="cublas")


def test_backends_build_dry_run_says_whose_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("LUCEPY_CACHE_DIR", str(tmp_path))

    def dry(*args):
        run = subprocess.run(
            [sys.executable, "-m", "lucepy", "backends", "build", "cuda", "--dry-run", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 0, run.stderr
        return " ".join(run.stdout.split())

    assert "kernels: lucepy's (hooks.patch on the pinned source)" in dry()
    out = dry("--kernels", "ggml")
    assert "kernels: ggml's" in out and "cuda-ggml" in out
    build = tmp_path / "ggml" / "cuda"
    build.mkdir(parents=True)
    (build / "libggml-base.so").write_bytes(b"")
    (build / backends.KERNELS_MARK).write_text("lucepy\n")
    run = subprocess.run(
        [sys.executable, "-m", "lucepy", "backends", "list", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(run.stdout)["builds"] == [
        {"backend": "cuda", "path": str(build), "kernels": "lucepy"}
    ]


def test_a_build_installs_over_the_one_before(tmp_path):
    """Libraries and their soname links are copied over an earlier build's (a rebuild into the
    same directory failed on the links), with the kernels mark."""
    built = tmp_path / "bin"
    built.mkdir()
    (built / "libggml-cuda.so.0.25.3").write_bytes(b"new")
    (built / "libggml-cuda.so.0").symlink_to("libggml-cuda.so.0.25.3")
    (built / "other.o").write_bytes(b"")
    plan = backends.plan_build("cuda", prefix=tmp_path / "prefix")
    for _ in range(2):
        backends.install(built, plan)
    prefix = plan.prefix
    assert (prefix / "libggml-cuda.so.0").is_symlink()
    assert (prefix / "libggml-cuda.so.0").read_bytes() == b"new"
    assert not (prefix / "other.o").exists()
    assert backends.build_kernels(prefix) == "lucepy"

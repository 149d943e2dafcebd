"""The one part of lucepy that pip compiles: its CPU kernel, vendor/ggml/cpu/lucepy-cpu.c, built
as the extension module lucepy.ggml._cpu. Everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "lucepy.ggml._cpu",
            ["vendor/ggml/cpu/lucepy-cpu.c"],
            # the kernel's sums must be ggml's: no multiply-add fused that ggml does not fuse
            extra_compile_args=["-O3", "-ffp-contract=off"],
        )
    ]
)

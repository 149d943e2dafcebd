#!/usr/bin/env bash
# Prepare what tools/gpu_run.sh needs on the GPU machine, which cannot reach a package registry:
#   .whl/    wheels of tools/gpu_wheels.txt for CPython 3.12 on x86-64
#   .whl-batch/  those of tools/gpu_wheels_batch.txt: GPU_RUN_BATCH's client (carried for it alone)
#   .sdist/  the pinned llama-cpp-python sdist, trimmed: its llama_cpp/ Python package and
#            vendor/llama.cpp without models, docs, tests, examples, the server's web UI and the
#            ggml backends other than CPU and CUDA
#   .gpuref/ llama.cpp's logits for the GPU tests, from llama-cpp-python's CPU build here
#            (tools/make_gpu_ref.py; this checkout installed with pip install -e .[dev])
# All are ignored through .git/info/exclude and carried with the run:
# carry [".whl", ".sdist", ".gpuref"] (and ".whl-batch" for GPU_RUN_BATCH). Run it again whenever
# the tiny test models change.
# Usage: tools/prepare_gpu_carry.sh [SDIST.tar.gz]   (default: /tmp/sdist/..., else pip download)
set -euo pipefail

cd "$(git rev-parse --show-toplevel)"
VERSION=0.3.36
NAME=llama_cpp_python-$VERSION
SDIST=${1:-/tmp/sdist/$NAME.tar.gz}
LIMIT_MIB=64

EXCLUDE=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCLUDE")" && touch "$EXCLUDE"
for path in /.whl/ /.whl-batch/ /.sdist/ /.gpuref/; do
    grep -qxF "$path" "$EXCLUDE" || echo "$path" >>"$EXCLUDE"
done

# --- the GPU tests' references: first, as a missing llama_cpp here is the likeliest failure ---
rm -rf .gpuref
python3 tools/make_gpu_ref.py .gpuref
python3 tools/make_gpu_ref.py --check .gpuref
echo "gpuref: $(du -sh .gpuref | cut -f1)"

# --- wheels: one version of each, or the --no-deps install there refuses ---
wheels() { # wheels LIST DIR
    rm -rf "$2" && mkdir "$2"
    grep -v '^\s*\(#\|$\)' "$1" | xargs python3 -m pip download -q --no-deps \
        --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$2"
    echo "wheels in $2: $(find "$2" -name '*.whl' | wc -l) files, $(du -sh "$2" | cut -f1)"
}
wheels tools/gpu_wheels.txt .whl
wheels tools/gpu_wheels_batch.txt .whl-batch

# --- the sdist, trimmed ---
if [[ ! -f $SDIST ]]; then
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tmp"
    SDIST=$tmp/$NAME.tar.gz
fi
rm -rf .sdist && mkdir .sdist
tar -xzf "$SDIST" -C .sdist \
    --exclude="$NAME/vendor/llama.cpp/models" --exclude="$NAME/vendor/llama.cpp/docs" \
    --exclude="$NAME/vendor/llama.cpp/media" --exclude="$NAME/vendor/llama.cpp/benches" \
    --exclude="$NAME/vendor/llama.cpp/tests" --exclude="$NAME/vendor/llama.cpp/examples" \
    --exclude="$NAME/vendor/llama.cpp/.github" --exclude="$NAME/vendor/llama.cpp/gguf-py" \
    --exclude="$NAME/vendor/llama.cpp/tools/ui" --exclude="$NAME/vendor/llama.cpp/tools/server" \
    --exclude="$NAME/vendor/llama.cpp/vendor/miniaudio" \
    --exclude="$NAME/vendor/llama.cpp/.devops" --exclude="$NAME/vendor/llama.cpp/conversion" \
    --exclude="$NAME/docs" --exclude="$NAME/examples" --exclude="$NAME/tests" \
    --exclude="$NAME/docker" --exclude="$NAME/.git" --exclude="$NAME/.github" \
    $(for b in opencl sycl vulkan hexagon metal et webgpu openvino cann virtgpu; do
        # backends the CUDA build does not enable: ggml_add_backend skips their folders
        echo "--exclude=$NAME/vendor/llama.cpp/ggml/src/ggml-$b"
    done)
test -f ".sdist/$NAME/vendor/llama.cpp/CMakeLists.txt"
test -f ".sdist/$NAME/llama_cpp/llama_cpp.py"
# llama-server's sources (tools/server, the web UI it links, and the audio library of the mtmd
# library it links), compressed: 2.8 MB instead of 14, for GPU_RUN_BATCH's llama-server -np N
# (tools/gpu_run.sh unpacks them there; no other target needs them)
tmp=$(mktemp -d)
tar -xzf "$SDIST" -C "$tmp" "$NAME/vendor/llama.cpp/tools/server" "$NAME/vendor/llama.cpp/tools/ui" \
    "$NAME/vendor/llama.cpp/vendor/miniaudio"
tar -cJf .sdist/server-ui.tar.xz -C "$tmp/$NAME/vendor/llama.cpp" tools/server tools/ui \
    vendor/miniaudio
rm -rf "$tmp"
echo "sdist: $(du -sh .sdist | cut -f1)"

# what travels, counted as a tar of it (each file's header and padding too): the device tool
# refused a carry of 63.3 MiB of files whose tar is 64.0 MiB (session 37)
carry_bytes() { # carry_bytes DIR...: the tree's files and those of DIR... as one tar
    { git ls-files -co --exclude-standard; find "$@" -type f; } | tar -cf - -T - | wc -c
}
total=$(carry_bytes .whl .sdist .gpuref)
batch=$(carry_bytes .whl .whl-batch .sdist .gpuref)
echo "carry: $((total >> 20)) MiB with the checkout (.whl .sdist .gpuref), $((batch >> 20)) MiB" \
    "with .whl-batch too (GPU_RUN_BATCH); the limit is ${LIMIT_MIB} MiB a call"
if ((batch > LIMIT_MIB << 20)); then
    echo "note: GPU_RUN_BATCH's carry is over ${LIMIT_MIB} MiB: leave .gpuref out of it" \
        "(GPU_RUN_SKIP=pytest)"
fi
if ((total > LIMIT_MIB << 20)); then
    echo "error: over ${LIMIT_MIB} MiB; trim .sdist further" >&2
    exit 1
fi

#!/usr/bin/env bash
# Build here, on the CPU machine, the CUDA builds that tools/gpu_run.sh otherwise makes on the GPU
# machine (about 4.5 minutes of its device time every call, as each call starts bare), and pack
# them for the carry:
#
#   tools/prebuild_gpu.sh build [SDIST_DIR]   # here (30-60 min on 2 cores) -> .gpubuild/
#   tools/gpu_run.sh OUTDIR                   # there, carry [".whl", ".gpubuild", ".gpuref"]
#   tools/prebuild_gpu.sh stamp               # what the builds were made from (gpu_run checks it)
#
# .gpubuild/ (git-ignored) holds:
#   builds.tar.xz   lucepy's build (its kernels hooked in, prefix cuda) and llama.cpp's unpatched
#                   one (llama-bench, llama-quantize, llama-server; prefix cuda-ggml), for sm_90
#   STAMP           tools/prebuild_gpu.sh stamp of the checkout that made them
#   llama_cpp_python-0.3.36/   what the run still reads from the sdist: the llama_cpp Python
#                   package and the headers, common/ and batched-bench sources that
#                   tools/build_llama_dflash.sh compiles against (seconds, there)
# gpu_run.sh unpacks the builds when the STAMP equals this checkout's and builds from .sdist
# otherwise (or stops, saying to run this again, when no .sdist was carried).
#
# This machine needs nvcc (CUDA 13, as there) and cuBLAS's headers, but no GPU, no cuBLAS library
# and no driver: the link uses stub libraries with the right sonames (libcublas.so.13,
# libcublasLt.so.13, libcuda.so.1) that define the names ggml-cuda calls; there, the real ones
# are loaded (LD_LIBRARY_PATH, set by gpu_run.sh). SDIST_DIR: the pinned sdist, unpacked
# (.sdist/llama_cpp_python-0.3.36 from tools/prepare_gpu_carry.sh by default).
# Knobs: PREBUILD_CUDA (the toolkit; nvcc's), PREBUILD_CUBLAS_INCLUDE (a folder with
# cublas_v2.h, when the toolkit lacks it), PREBUILD_DIR (/tmp/lucepy-prebuild: the work tree,
# kept, so that a build cut short resumes).
set -euo pipefail

cd "$(dirname "$0")/.."
NAME=llama_cpp_python-0.3.36
ARCH=90

# stamp: the build recipes, lucepy's CUDA sources and the exact build commands of both builds
stamp() {
    {
        cat vendor/ggml/recipes.toml vendor/ggml/cuda/*
        python3 -m lucepy backends build cuda --arch $ARCH --prefix /p --dry-run
        python3 -m lucepy backends build cuda --arch $ARCH --prefix /p --dry-run --kernels ggml \
            --with-llama-bench
    } | sha256sum | cut -d' ' -f1
}

# stubs DIR SRC...: link-only libcublas.so.13, libcublasLt.so.13 and libcuda.so.1 in DIR, defining
# every cuBLAS and driver function the sources name, as the headers' macros spell them (cublasCreate
# is cublasCreate_v2)
stubs() {
    local dir=$1 cuda=$2 inc=$3 tmp
    shift 3
    tmp=$(mktemp -d)
    {
        printf '#include <cuda.h>\n#include <cublas_v2.h>\n'
        grep -ohE '\b(cublas[A-Z][A-Za-z0-9_]*|cu[A-Z][A-Za-z0-9_]*)\s*\(' -r "$@" |
            tr -d '( ' | sort -u | sed 's/^/LUCEPY_STUB /'
    } >"$tmp/names.c"
    gcc -E -P -I "$cuda/include" -I "$inc" "$tmp/names.c" | awk '$1 == "LUCEPY_STUB" {print $2}' |
        grep -E '^cu' | sort -u | sed 's/.*/void &(void) {}/' >"$tmp/stub.c"
    mkdir -p "$dir/stubs"
    for so in libcublas.so.13 libcublasLt.so.13; do
        gcc -shared -fPIC -o "$dir/$so" -Wl,-soname,$so "$tmp/stub.c"
        ln -sf $so "$dir/${so%.13}"
    done
    gcc -shared -fPIC -o "$dir/stubs/libcuda.so" -Wl,-soname,libcuda.so.1 "$tmp/stub.c"
    echo "stubs: $(wc -l <"$tmp/stub.c") functions in $dir"
    rm -rf "$tmp"
}

build() {
    local sdist=${1:-.sdist/$NAME} work=${PREBUILD_DIR:-/tmp/lucepy-prebuild} nvcc cuda inc
    local src out ggml_cuda
    [[ -d $sdist/vendor/llama.cpp ]] || {
        echo "prebuild_gpu: no sdist at $sdist: run tools/prepare_gpu_carry.sh" >&2
        exit 2
    }
    nvcc=$(command -v nvcc) || { echo "prebuild_gpu: no nvcc here" >&2 && exit 2; }
    # nvcc's own idea of its toolkit (it may be a wrapper script elsewhere)
    cuda=${PREBUILD_CUDA:-$(nvcc --dryrun -x cu -c /dev/null -o /dev/null 2>&1 |
        awk -F= '/TOP=/{print $2; exit}')}
    cuda=$(readlink -f "${cuda:-$(dirname "$(dirname "$nvcc")")}")
    inc=${PREBUILD_CUBLAS_INCLUDE:-$cuda/include}
    [[ -f $inc/cublas_v2.h ]] || {
        echo "prebuild_gpu: no cublas_v2.h in $inc: set PREBUILD_CUBLAS_INCLUDE" >&2
        exit 2
    }
    mkdir -p "$work"
    src=$work/src/$NAME out=$work/out
    # a toolkit copy with cuBLAS's headers and the stub libraries beside the real cudart
    if [[ ! -d $work/cuda ]]; then
        cp -rL "$cuda" "$work/cuda.part" && mv "$work/cuda.part" "$work/cuda"
    fi
    cp -n "$inc"/cublas*.h "$work/cuda/include/" 2>/dev/null || true
    if [[ ! -d $src ]]; then
        mkdir -p "$work/src" && cp -a "$sdist" "$work/src/"
        tar -xJf "$(dirname "$sdist")/server-ui.tar.xz" -C "$src/vendor/llama.cpp"
    fi
    ggml_cuda=$src/vendor/llama.cpp/ggml/src/ggml-cuda
    stubs "$work/cuda/lib64" "$work/cuda" "$inc" "$ggml_cuda" vendor/ggml/cuda

    export CUDACXX=$work/cuda/bin/nvcc CUDAToolkit_ROOT=$work/cuda PATH=$work/cuda/bin:$PATH
    export LUCEPY_BUILD_DIR=$work/tree
    if command -v ninja >/dev/null; then export CMAKE_GENERATOR=Ninja; fi
    rm -rf "$out" && mkdir -p "$out"
    python3 -m lucepy -v backends build cuda --arch $ARCH --sdist "$src" --prefix "$out/cuda"
    python3 -m lucepy -v backends build cuda --arch $ARCH --sdist "$src" --kernels ggml \
        --with-llama-bench --prefix "$out/cuda-ggml"
    # llama-server: the unpatched tree again, the server on (as gpu_run.sh's build_llama_server)
    cmake -S "$src/vendor/llama.cpp" -B "$work/tree/build" -DLLAMA_BUILD_SERVER=ON >/dev/null
    cmake --build "$work/tree/build" -j "$(nproc)" --target llama-server
    for f in "$work/tree/build/bin/llama-server" "$work/tree/build/bin"/lib*.so*; do
        [[ -e $out/cuda-ggml/$(basename "$f") ]] || cp -a "$f" "$out/cuda-ggml/"
    done
    if ldd "$out"/cuda*/lib*.so "$out/cuda-ggml/llama-server" | grep -q 'lucepy-prebuild'; then
        echo "prebuild_gpu: a build links a stub by path" >&2 && exit 1
    fi

    rm -rf .gpubuild && mkdir -p ".gpubuild/$NAME/vendor/llama.cpp/tools"
    tar -cJf .gpubuild/builds.tar.xz -C "$out" cuda cuda-ggml
    cp -a "$sdist/llama_cpp" ".gpubuild/$NAME/"
    for d in include common ggml/include vendor/nlohmann tools/batched-bench; do
        mkdir -p ".gpubuild/$NAME/vendor/llama.cpp/$(dirname $d)"
        cp -a "$sdist/vendor/llama.cpp/$d" ".gpubuild/$NAME/vendor/llama.cpp/$d"
    done
    stamp >.gpubuild/STAMP
    grep -qxF /.gpubuild/ .git/info/exclude || echo /.gpubuild/ >>.git/info/exclude
    du -sh .gpubuild .whl .gpuref 2>/dev/null || true
    echo "carry [\".whl\", \".gpubuild\", \".gpuref\"] (no .sdist needed)"
}

case ${1:-} in
stamp) stamp ;;
build) build "${2:-}" ;;
*) echo "usage: tools/prebuild_gpu.sh build [SDIST_DIR] | stamp" >&2 && exit 2 ;;
esac

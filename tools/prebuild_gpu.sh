#!/usr/bin/env bash
# Build here, on the CPU machine, the CUDA build that tools/gpu_run.sh otherwise makes on the GPU
# machine (4-5 minutes of its device time every call, as each call starts bare), and pack it for
# the carry:
#
#   tools/prebuild_gpu.sh build [SDIST_DIR]   # here (about 30 min on 2 cores; on the tree kept
#                                             # from the last, lucepy's files alone: 80-120 s)
#                                             # -> .gpubuild*/ (.lpbuild*/: below)
#   tools/prebuild_gpu.sh stage .gpubuild1    # there, carry [".gpubuild1"]: one call a part,
#                                             # on the still-warm machine (it is kept 30 s)
#   tools/gpu_run.sh OUTDIR                   # there, carry [".whl", ".gpubuild", ".gpuref"]
#   tools/prebuild_gpu.sh stamp               # what the build was made from (gpu_run checks it)
#
# The build is llama.cpp's, unpatched (prefix cuda-ggml: libggml*, libllama*, llama-bench,
# llama-quantize, llama-server; sm_90), and lucepy loads it too (lucepy's own kernels are off by
# default; a run that measures them, GPU_RUN_KERNELS, builds there); or, with
# PREBUILD_KERNELS=lucepy, lucepy's own (prefix cuda, packed as .lpbuild*: below), which such a
# run then unpacks instead of building, where the kernels' sources are those it was built from.
# Packed it is about 45 MB, more than one call carries beside the repo and the wheels (64 MiB in
# all), so it is split:
#   .gpubuild/      STAMP (this checkout's stamp, the parts and their sha256), the last part, and
#                   what the run still reads from the sdist: the llama_cpp Python package and the
#                   headers, common/ and batched-bench sources that tools/build_llama_dflash.sh
#                   compiles against (seconds, there)
#   .gpubuild1/ ... the other parts, each staged by its own call into /tmp/lucepy-gpubuild
# gpu_run.sh unpacks the build when every part is there and the STAMP equals this checkout's, and
# builds from .sdist otherwise (or stops, saying so, when no .sdist was carried). All of them are
# git-ignored (.git/info/exclude).
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
STAGE=/tmp/lucepy-gpubuild
PART_MB=34 # a stage call carries the repo (about 27 MiB) and one part
LAST_MB=20 # the run carries the repo, the wheels, .gpuref and .gpubuild

# PREBUILD_KERNELS=lucepy: lucepy's build instead (its own kernels hooked in, with llama-bench and
# llama-quantize: the "llama.cpp, its kernels off" side of a run that skips build-ggml), packed
# as .lpbuild/ and .lpbuild1.., stamped with the kernels' sources too: gpu_run.sh unpacks it into
# $BUILD where the stamp is this checkout's, so a run on unchanged kernels builds nothing
KERNELS=${PREBUILD_KERNELS:-ggml}
case $KERNELS in
ggml) PACKED=.gpubuild OUTNAME=cuda-ggml ;;
lucepy) PACKED=.lpbuild OUTNAME=cuda STAGE=/tmp/lucepy-lpbuild ;;
*) echo "prebuild_gpu: PREBUILD_KERNELS is ggml or lucepy" >&2 && exit 2 ;;
esac

# stamp: the build recipes and the exact build command (lucepy's: and its kernels' sources)
stamp() {
    {
        cat vendor/ggml/recipes.toml
        if [[ $KERNELS == lucepy ]]; then
            cat vendor/ggml/cuda/*
            python3 -m lucepy backends build cuda --arch $ARCH --prefix /p --dry-run \
                --with-llama-bench
        else
            python3 -m lucepy backends build cuda --arch $ARCH --prefix /p --dry-run \
                --kernels ggml --with-llama-bench
        fi
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
        sort -u >"$tmp/names"
    # each name in the library that has it: the link records which libraries are needed
    grep -E '^cublas[A-Z]' "$tmp/names" | sed 's/.*/void &(void) {}/' >"$tmp/cublas.c"
    grep -E '^cu[A-Z]' "$tmp/names" | sed 's/.*/void &(void) {}/' >"$tmp/cuda.c"
    echo 'void cublasLtCreate(void) {}' >"$tmp/cublasLt.c"
    mkdir -p "$dir/stubs"
    for so in cublas cublasLt; do
        gcc -shared -fPIC -o "$dir/lib$so.so.13" -Wl,-soname,lib$so.so.13 "$tmp/$so.c"
        ln -sf lib$so.so.13 "$dir/lib$so.so"
    done
    gcc -shared -fPIC -o "$dir/stubs/libcuda.so" -Wl,-soname,libcuda.so.1 "$tmp/cuda.c"
    ln -sf libcuda.so "$dir/stubs/libcuda.so.1"
    echo "stubs: $(wc -l <"$tmp/cublas.c") cuBLAS and $(wc -l <"$tmp/cuda.c") driver functions"
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
    stubs "$work/cuda/lib64" "$work/cuda" "$inc" "$ggml_cuda"

    export CUDACXX=$work/cuda/bin/nvcc CUDAToolkit_ROOT=$work/cuda PATH=$work/cuda/bin:$PATH
    export LUCEPY_BUILD_DIR=$work/tree
    # the linker looks for a library's own needs (libcublas.so.13, ...) here
    export LD_LIBRARY_PATH=$work/cuda/lib64:$work/cuda/lib64/stubs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    if command -v ninja >/dev/null; then export CMAKE_GENERATOR=Ninja; fi
    rm -rf "$out" && mkdir -p "$out"
    if [[ $KERNELS == lucepy ]]; then # (its tree apart: the unpatched build's stays as it was)
        LUCEPY_BUILD_DIR=$work/tree-lucepy python3 -m lucepy -v backends build cuda --arch $ARCH \
            --sdist "$src" --with-llama-bench --prefix "$out/cuda"
        no_stub_paths "$work" "$out"/cuda/lib*.so "$out"/cuda/llama-*
        pack "$sdist" "$out"
        return
    fi
    python3 -m lucepy -v backends build cuda --arch $ARCH --sdist "$src" --kernels ggml \
        --with-llama-bench --prefix "$out/cuda-ggml"
    # llama-server: the same tree again, the server on (as gpu_run.sh's build_llama_server)
    cmake -S "$src/vendor/llama.cpp" -B "$work/tree/build" -DLLAMA_BUILD_SERVER=ON >/dev/null
    cmake --build "$work/tree/build" -j "$(nproc)" --target llama-server
    for f in "$work/tree/build/bin/llama-server" "$work/tree/build/bin"/lib*.so*; do
        [[ -e $out/cuda-ggml/$(basename "$f") ]] || cp -a "$f" "$out/cuda-ggml/"
    done
    no_stub_paths "$work" "$out"/cuda-ggml/lib*.so "$out/cuda-ggml/llama-server"
    pack "$sdist" "$out"
}

# no_stub_paths WORK FILE...: fail if a built file needs a library of WORK's toolkit copy (its
# stubs) by path, where the machine's own must load (the build's own libraries, beside it, are
# found through $ORIGIN)
no_stub_paths() {
    local work=$1
    shift
    if ldd "$@" | grep -q "$work/cuda/"; then
        echo "prebuild_gpu: a build links a stub by path" >&2 && exit 1
    fi
}

# pack SDIST OUT: $PACKED (STAMP, sources, the last part) and ${PACKED}1.. (the other parts)
pack() {
    local sdist=$1 out=$2 tmp parts n i=0 d
    rm -rf "$PACKED" "$PACKED"[0-9]* && mkdir -p "$PACKED/$NAME/vendor/llama.cpp/tools"
    tmp=$(mktemp -d)
    tar -cf - -C "$out" $OUTNAME | xz -T2 -6 >"$tmp/build.tar.xz"
    (cd "$tmp" && split -b ${PART_MB}M build.tar.xz part.)
    parts=("$tmp"/part.*)
    n=${#parts[@]}
    {
        echo "stamp $(stamp)"
        echo "parts $n $(sha256sum "$tmp/build.tar.xz" | cut -d' ' -f1)"
    } >"$PACKED/STAMP"
    for d in "${parts[@]}"; do
        i=$((i + 1))
        if ((i == n)) && (($(stat -c %s "$d") <= LAST_MB * 2**20)); then
            mv "$d" "$PACKED/"
        else
            mkdir -p "$PACKED$i" && mv "$d" "$PACKED$i/"
        fi
    done
    rm -rf "$tmp"
    cp -a "$sdist/llama_cpp" "$PACKED/$NAME/"
    for d in include common ggml/include vendor/nlohmann tools/batched-bench; do
        mkdir -p "$PACKED/$NAME/vendor/llama.cpp/$(dirname $d)"
        cp -a "$sdist/vendor/llama.cpp/$d" "$PACKED/$NAME/vendor/llama.cpp/$d"
    done
    for d in "$PACKED" "$PACKED"[0-9]*; do
        grep -qxF "/$d/" .git/info/exclude || echo "/$d/" >>.git/info/exclude
    done
    du -sh "$PACKED"* .whl .gpuref 2>/dev/null || true
    echo "stage each ${PACKED}N (PREBUILD_KERNELS=$KERNELS tools/prebuild_gpu.sh stage ${PACKED}N," \
        "carry [\"${PACKED}N\"]), then run with carry [\".whl\", \"$PACKED\", \".gpuref\"] (no .sdist" \
        "needed)"
}

# stage DIR: there, a carried part into $STAGE, where gpu_run.sh finds it
stage() {
    mkdir -p $STAGE && cp "${1:?a carried folder such as ${PACKED}1}"/part.* $STAGE/ && ls -la $STAGE
}

# unpack PREFIX_DIR: there, the parts (staged, or carried in $PACKED*) checked and unpacked into
# PREFIX_DIR/$OUTNAME; says why not and fails when a part is missing or the stamp differs
unpack() {
    local into=$1 want n sum
    [[ -f $PACKED/STAMP ]] || { echo "no $PACKED/STAMP" && return 1; }
    want=$(stamp)
    if [[ $(awk '$1 == "stamp" {print $2}' "$PACKED/STAMP") != "$want" ]]; then
        echo "$PACKED was made from other recipes, kernels or build flags: run" \
            "PREBUILD_KERNELS=$KERNELS tools/prebuild_gpu.sh build again" && return 1
    fi
    read -r _ n sum < <(grep '^parts ' "$PACKED/STAMP")
    mkdir -p $STAGE && cp "$PACKED"*/part.* $STAGE/ 2>/dev/null || true
    if (($(find $STAGE -name 'part.*' | wc -l) != n)); then
        echo "$n parts make the build; staged: $(cd $STAGE && echo part.*): stage the others" \
            "(PREBUILD_KERNELS=$KERNELS tools/prebuild_gpu.sh stage ${PACKED}N) on this warm" \
            "machine first" && return 1
    fi
    if [[ $(cat $STAGE/part.* | sha256sum | cut -d' ' -f1) != "$sum" ]]; then
        echo "the staged parts are not those of $PACKED/STAMP: stage them again" && return 1
    fi
    mkdir -p "$into" && cat $STAGE/part.* | xz -d | tar -xf - -C "$into"
    echo "unpacked $n parts into $into/$OUTNAME"
}

case ${1:-} in
stamp) stamp ;;
build) build "${2:-}" ;;
pack) pack "${2:?SDIST}" "${3:?OUT}" ;;
stage) stage "${2:-}" ;;
unpack) unpack "${2:?the folder that gets $OUTNAME}" ;;
*) echo "usage: tools/prebuild_gpu.sh build [SDIST_DIR] | stage DIR | unpack DIR | stamp" >&2
    exit 2 ;;
esac

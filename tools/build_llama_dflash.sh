#!/usr/bin/env bash
# Compile tools/llama_dflash.cpp (llama.cpp's DFlash and plain decoding on pre-tokenized prompts)
# against an existing llama.cpp build, in seconds, without rebuilding llama.cpp; with
# --batched-bench, the pinned source's own llama-batched-bench (tools/batched-bench/*.cpp, built
# from SRC, never copied here) instead, for tools/bench_batch.py.
#
#   tools/build_llama_dflash.sh [--batched-bench] BUILD SRC [OUT]
#
# BUILD: a build made by `python3 -m lucepy backends build cpu|cuda --with-llama-bench` (its
#   prefix, e.g. ~/.cache/lucepy/ggml/cpu, or $BUILD in tools/gpu_run.sh), or that build's CMake
#   tree (its bin/ is used). It must hold libllama.so, libggml*.so and libllama-common.so: common/
#   is a shared library of BUILD_SHARED_LIBS builds, made because llama-bench links it, and
#   `backends build` copies it with the other libllama* files.
# SRC: the llama.cpp source that BUILD was made from (its include/, common/ and ggml/include/), or
#   the llama-cpp-python sdist folder around it (vendor/llama.cpp is then used).
# OUT: the binary, BUILD/llama-dflash (BUILD/llama-batched-bench) unless given; it finds the
#   libraries in BUILD at run time.
set -euo pipefail

usage="usage: tools/build_llama_dflash.sh [--batched-bench] BUILD SRC [OUT]"
die() { printf 'build_llama_dflash: %s\n' "$*" >&2 && exit 2; }
TOOL=dflash
if [[ ${1:-} == --batched-bench ]]; then
    TOOL=batched-bench
    shift
fi

(($# >= 2)) || die "$usage"
BUILD=$1
SRC=$2
HERE=$(cd "$(dirname "$0")" && pwd)

[[ -d $BUILD ]] || die "no build directory $BUILD: build one with \`python3 -m lucepy backends" \
    "build cpu --with-llama-bench\` (or cuda), then pass its prefix"
BUILD=$(cd "$BUILD" && pwd)
if [[ ! -e $BUILD/libllama.so && -e $BUILD/bin/libllama.so ]]; then BUILD=$BUILD/bin; fi
[[ -e $BUILD/libllama.so ]] || die "$BUILD has no libllama.so: rebuild it with" \
    "\`python3 -m lucepy backends build BACKEND --with-llama-bench\`"
if [[ ! -e $BUILD/libllama-common.so ]]; then
    die "$BUILD has no libllama-common.so (llama.cpp's common/): rebuild with --with-llama-bench," \
        "or, in a kept CMake tree (LUCEPY_BUILD_DIR), build only it:" \
        "cmake --build TREE --target llama-common -j2, then pass TREE"
fi

if [[ -f $SRC/include/llama.h ]]; then
    :
elif [[ -f $SRC/vendor/llama.cpp/include/llama.h ]]; then
    SRC=$SRC/vendor/llama.cpp
else
    die "$SRC is not a llama.cpp source (no include/llama.h, nor vendor/llama.cpp/include/llama.h):" \
        "pass the pinned sdist, e.g. .sdist/llama_cpp_python-0.3.36"
fi
for f in common/common.h common/speculative.h ggml/include/gguf.h; do
    [[ -f $SRC/$f ]] || die "$SRC has no $f: it is not the source the build was made from"
done

OUT=${3:-$BUILD/llama-$TOOL}
SOURCES=("$HERE/llama_dflash.cpp")
if [[ $TOOL == batched-bench ]]; then
    SOURCES=("$SRC/tools/batched-bench/batched-bench.cpp" "$SRC/tools/batched-bench/main.cpp")
    [[ -f ${SOURCES[0]} ]] || die "$SRC has no tools/batched-bench/batched-bench.cpp"
fi
t0=$SECONDS
# shellcheck disable=SC2016  # $ORIGIN is for the dynamic linker
"${CXX:-c++}" -std=c++17 -O2 -o "$OUT" "${SOURCES[@]}" \
    -I "$SRC/include" -I "$SRC/common" -I "$SRC/ggml/include" -I "$SRC/vendor" \
    -L "$BUILD" -lllama-common -lllama -lggml -lggml-base -pthread \
    -Wl,-rpath,'$ORIGIN' -Wl,-rpath,"$BUILD"
echo "built $OUT in $((SECONDS - t0))s (libraries from $BUILD, headers from $SRC)"

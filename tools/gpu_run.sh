#!/usr/bin/env bash
# One GPU run (issue 7) on a fresh H200 machine that cannot reach a package registry, inside the
# device tool's 10 minutes: install the carried wheels, build the pinned ggml for CUDA (sm_90) with
# libllama and llama-bench, generate a random Q4_0 GGUF of a real model's shapes (Qwen3.6-27B;
# Gemma 4 31B with GPU_RUN_ARCH=gemma4; Qwen3.6-35B-A3B with a skewed router with
# GPU_RUN_ARCH=qwen35moe) in the background, during the build, run the GPU tests, then llama-bench
# and lucepy on that model (for qwen35moe: all experts on the GPU, then half of them in host RAM,
# by llama.cpp's --n-cpu-moe and by lucepy's hotness placement: tools/bench_moe.py).
#
#   tools/prepare_gpu_carry.sh          # here: .whl/, .whl-batch/, .sdist/ and .gpuref/
#   tools/gpu_run.sh OUTDIR             # there, with carry [".whl", ".sdist", ".gpuref"]
#                                       # (and ".whl-batch" for GPU_RUN_BATCH)
#
# or, with the CUDA build made here beforehand (no build there: 4-5 minutes less a call),
#   tools/prebuild_gpu.sh build         # here: .gpubuild/, .gpubuild1/ (they replace .sdist)
#   tools/prebuild_gpu.sh stage .gpubuild1   # there, carry [".gpubuild1"], then at once:
#   tools/gpu_run.sh OUTDIR             # there, with carry [".whl", ".gpubuild", ".gpuref"]
#
# and lucepy's own build alike (PREBUILD_KERNELS=lucepy: .lpbuild/, .lpbuild1/, ...; used where
# its stamp, which holds the kernels' sources, is this checkout's, with "build-ggml" skipped:
#   PREBUILD_KERNELS=lucepy tools/prebuild_gpu.sh build          # here, about 25 min
#   PREBUILD_KERNELS=lucepy tools/prebuild_gpu.sh stage .lpbuild1  # there, carry [".lpbuild1"]
#   tools/gpu_run.sh OUTDIR             # there, with carry [".whl", ".lpbuild", ".gpuref"]
#
# .gpuref holds llama.cpp's logits for the GPU tests, made here by tools/make_gpu_ref.py (its CUDA
# Python path segfaults there). The run stops at once, saying what to run, if it is missing or made
# for other tiny models than the tests write (unless GPU_RUN_SKIP names pytest).
#
# OUTDIR gets 7 files (8 for qwen35moe: llama-bench-ncmoe.json; kvpool.json with GPU_RUN_KVPOOL):
# setup.log build.log pytest.txt bench.log llama-bench.json lucepy-bench.json summary.md; where
# the steps wrote more than 8 (the device tool's limit), all.tar.gz holds them all, summary.md
# and kernels.md beside it. Each step has a time budget, cut to what is left before GPU_RUN_DEADLINE (seconds
# since start); a step that runs out is stopped and the run goes on. The build and the model stay
# in /tmp: a second call on the still-warm machine (30 s) skips them, or resumes the build (lucepy's
# build again, incrementally, where vendor/ggml/cuda or the recipes changed since it was made).
# Knobs: GPU_RUN_ARCH (qwen35, gemma4, qwen35moe or laguna), GPU_RUN_LAYERS (the real model's),
# GPU_RUN_THREADS (8: CPU threads of the MoE runs, both sides),
# GPU_RUN_DEADLINE (570), GPU_RUN_SKIP (step names, e.g. "pytest llama"), GPU_RUN_DEVICE (cuda:0),
# GPU_RUN_TESTS (the GPU test files, default all; GPU_RUN_TEST_BUDGET their step's seconds, 240:
# 117 tests took 136-149 s on one H200 and more than 180 on another), GPU_RUN_TEST_KERNELS
# (unset: the tests run on the kernels a user's run gets, lucepy's on compute capability 9.0 and
# newer; 1 or 0 forces lucepy's or ggml's; on the prebuilt build always 0, and
# tests/test_gpu_kernels.py left out),
# GPU_RUN_CACHE (/tmp/lucepy-cache), GPU_RUN_CUDA (the toolkit), GPU_RUN_DIAG (set: also the
# decode without CUDA graphs on both sides, tools/trace_gpu.py's CUPTI trace and its Nsight
# Compute kernel lists), GPU_RUN_KVPOOL (depths, e.g. 8192,32768,131072: KV Flash's benchmark,
# tools/bench_kvpool.py, before the others; GPU_RUN_POOL its pool, 4096; adds kvpool.json),
# GPU_RUN_DFLASH (set: DFlash on SmolLM2, staged first by tools/gpu_train.sh's stage calls, with
# the shipped draft, against llama.cpp's, tools/bench_dflash.py; adds dflash.json, dflash.md;
# GPU_RUN_DFLASH=ggml also runs lucepy's side again on ggml's kernels, LUCEPY_CUDA_KERNELS=0:
# dflash-ggml.json, dflash-ggml.md),
# GPU_RUN_BATCH (clients, e.g. 1,4,8,32: `lucepy serve --parallel N` on the model against
# llama-server -np N and llama-batched-bench of the unpatched build, tools/bench_batch.py, medians
# of 3 runs a level; "engine" and "batched-bench" in GPU_RUN_SKIP leave out those sides; adds
# batch.json, batch.md),
# GPU_RUN_KERNELS (set: issue 19's benchmark, tools/bench_kernels.py, on the model in Q4_0 and in
# Q4_K_M (requantized by llama-quantize), lucepy with its kernels and with ggml's against
# llama-bench of the unpatched build (with "build-ggml" skipped: lucepy's build, made with
# llama-bench and llama-quantize, its kernels off), and the CUPTI trace of a decode token with
# each; adds kernels.md, kernels-*.json, llama-bench-*.json, trace-*.json; GPU_RUN_TRACE_VERIFY=K
# also traces a K-token verify with each (its kernels in order: verify-seq*.txt, a decode's in
# decode-seq*.txt; each kernel's share of the span in both, side by side: path*.md; each part
# of a layer in both: layers*.md);
# GPU_RUN_REQUANT=TYPE requantizes to TYPE, e.g. Q5_K_M, in place of Q4_K_M (by the build's
# llama-quantize, in the background while the GPU tests run; the benchmarks wait for it, so that
# none shares the CPU with it: 177-216 s that a run had spent after the Q4_0 model's); "llama-q4_0
# kernels-q4_0" in GPU_RUN_SKIP leave the Q4_0 model's out; GPU_RUN_AB=NAME, e.g.
# LUCEPY_CUDA_F8, measures that switch both ways on the Q4_0 model, two rounds in turn: ab.md;
# NAME=A,B, e.g. LUCEPY_CUDA_F8_SINGLE=6,7, its values A and B where 0 and 1).
# lucepy runs on $BUILD (its own CUDA kernels); every llama.cpp binary comes from $BUILD_GGML,
# the same source unpatched ("build-ggml" in GPU_RUN_SKIP leaves it out, for lucepy-only
# runs: about 150 s less). GPU_RUN_STACK (set: lucepy's benchmark again with
# LUCEPY_STACK_MATMULS=0, products of one input not stacked into one, as they are on a CPU and
# were everywhere before; adds lucepy-unstacked.json). GPU_RUN_HOST (set: tools/host_time.py on
# the model, a decode's and a 16-token verify's wall time by phase on the host; adds host.json).
# GPU_RUN_AFTER (a bash command, run last, before the summary, in this run's environment: its
# PYTHONPATH, LUCEPY_GGML_LIB and MODEL, OUTDIR exported; for a same-run comparison of a knob,
# e.g. two tools/bench_kernels.py "one" runs with an environment variable each way: a command
# started after this script has returned finds none of it).
set -euo pipefail

OUTDIR=${1:?usage: tools/gpu_run.sh OUTDIR}
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)

export NAME=llama_cpp_python-0.3.36
export ARCH=${GPU_RUN_ARCH:-qwen35}
case $ARCH in
qwen35) export LAYERS=${GPU_RUN_LAYERS:-64} SHAPE=qwen36-27b ;;
gemma4) export LAYERS=${GPU_RUN_LAYERS:-60} SHAPE=gemma4-31b ;;
qwen35moe) export LAYERS=${GPU_RUN_LAYERS:-40} SHAPE=qwen36-35b-a3b ;;
laguna) export LAYERS=${GPU_RUN_LAYERS:-40} SHAPE=laguna-xs2 ;;
*) echo "gpu_run: GPU_RUN_ARCH=$ARCH: use qwen35, gemma4, qwen35moe or laguna" >&2 && exit 2 ;;
esac
DEADLINE=${GPU_RUN_DEADLINE:-570}
export SKIP=" ${GPU_RUN_SKIP:-} "
DEPTH=8192
DEVICE=${GPU_RUN_DEVICE:-cuda:0}
CUDA_ROOT=${GPU_RUN_CUDA:-/usr/local/cuda}
if [[ ! -x $CUDA_ROOT/bin/nvcc ]] && command -v nvcc >/dev/null; then
    CUDA_ROOT=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
fi
export LUCEPY_CACHE_DIR=${GPU_RUN_CACHE:-/tmp/lucepy-cache}
export BUILD=$LUCEPY_CACHE_DIR/ggml/cuda           # lucepy's: with its own kernels (issue 19)
export BUILD_GGML=$LUCEPY_CACHE_DIR/ggml/cuda-ggml # llama.cpp's: ggml's kernels, llama-bench
# GPU_RUN_KERNELS's llama-bench and llama-quantize: the unpatched build's or, where "build-ggml" is
# skipped, lucepy's own build's (built with them) with its kernels forced off
export LLAMA_BIN=$BUILD_GGML LLAMA_OFF="" LLAMA_BUILD=unpatched # exported: steps run in bash -c
if [[ -n ${GPU_RUN_KERNELS:-} && " ${GPU_RUN_SKIP:-} " == *" build-ggml "* ]]; then
    LLAMA_BIN=$BUILD LLAMA_OFF=LUCEPY_CUDA_KERNELS=0
    LLAMA_BUILD="lucepy's build, its kernels off"
fi
export LUCEPY_BUILD_DIR=/tmp/lucepy-build # kept: a build cut short resumes on the next call
export MODEL=/tmp/lucepy-$SHAPE-L$LAYERS-q4_0.gguf
# the sdist (.sdist) or, from tools/prebuild_gpu.sh, the builds and the parts of it still read
SOURCES=.sdist
if [[ ! -d .sdist && -d .lpbuild ]]; then SOURCES=.lpbuild; fi
if [[ ! -d .sdist && -d .gpubuild ]]; then SOURCES=.gpubuild; fi
export SOURCES
SITE=/tmp/site
export PYTHONUNBUFFERED=1
if command -v ninja >/dev/null; then export CMAKE_GENERATOR=Ninja; fi
export PYTHONPATH=$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}
export LUCEPY_GGML_LIB=$BUILD LLAMA_CPP_LIB_PATH=$BUILD_GGML
export LUCEPY_GPU_REF=$REPO/.gpuref # read by tests/test_gpu.py
SETUP=$OUTDIR/setup.log
BENCHLOG=$OUTDIR/bench.log
SUMMARY=()

say() { echo "[$(printf '%3d' "$SECONDS")s] $*"; }

noted() { # noted NAME OUTCOME SECONDS [BUDGET]
    SUMMARY+=("$(printf '%-10s %-12s %5s %s' "$1" "$2" "${3}s" "${4:+of ${4}s}")")
    say "$1: $2 after $3s"
}

skipping() { # skipping NAME: whether GPU_RUN_SKIP names the step, or no time is left
    if [[ $SKIP == *" $1 "* ]] || ((DEADLINE - SECONDS < 15)); then
        noted "$1" skipped 0
        return 0
    fi
    return 1
}

# inline NAME LOG CMD...: CMD in this shell (what it exports stays), with no timeout
inline() {
    local name=$1 log=$2 t0=$SECONDS how=ok
    shift 2
    skipping "$name" && return 1
    say "$name: start"
    "$@" >>"$log" 2>&1 || how=failed
    noted "$name" "$how" $((SECONDS - t0))
    [[ $how == ok ]]
}

# step NAME BUDGET LOG CMD...: CMD (a program or an exported function) under a timeout of BUDGET
# seconds, or of what is left before the deadline; output to LOG. Returns CMD's status.
step() {
    local name=$1 budget=$2 log=$3 left rc=0 t0=$SECONDS how=ok
    shift 3
    skipping "$name" && return 1
    left=$((DEADLINE - SECONDS))
    if ((budget > left)); then budget=$left; fi
    say "$name: start, budget ${budget}s"
    echo "== $name: $* (budget ${budget}s)" >>"$log"
    timeout -k 10 "$budget" bash -c '"$@"' "$name" "$@" >>"$log" 2>&1 || rc=$?
    if ((rc == 124 || rc == 137)); then how="timed out"; elif ((rc != 0)); then how="failed $rc"; fi
    noted "$name" "$how" $((SECONDS - t0)) "$budget"
    return $rc
}

stop() { # stop MESSAGE: the run cannot do its job; say why and what to do, in the summary too
    printf 'gpu_run: error: %s\n' "$*" | tee -a "$OUTDIR/summary.md" >&2
    exit 2
}

# check_gpuref quick|full: without current references 4 of the 7 GPU tests fail; quick needs no
# Python packages, full (after the wheels) writes the tests' tiny models again and compares
check_gpuref() {
    local found fix='on the CPU machine, run tools/prepare_gpu_carry.sh (or just python'
    fix+=' tools/make_gpu_ref.py .gpuref), then carry [".whl", ".sdist" (or ".gpubuild" or ".lpbuild"), ".gpuref"]'
    if [[ $SKIP == *" pytest "* ]]; then return 0; fi
    if [[ ! -d $LUCEPY_GPU_REF ]]; then
        stop "no .gpuref (llama.cpp's logits for the GPU tests) was carried: $fix; or set" \
            "GPU_RUN_SKIP=pytest to run without the GPU tests"
    fi
    if [[ $1 == full ]]; then
        found=$(python3 tools/make_gpu_ref.py --check "$LUCEPY_GPU_REF" 2>&1) || stop "$found"
        echo "$found" >>"$SETUP"
    fi
}

install_wheels() { # .whl's, and .whl-batch's where carried (GPU_RUN_BATCH's client)
    local batch=()
    if [[ -d .whl-batch ]]; then batch=(.whl-batch/*.whl); fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl ${batch[@]+"${batch[@]}"}
    # llama-cpp-python's Python side, as source; LLAMA_CPP_LIB_PATH points it at our libllama
    cp -r "$SOURCES/$NAME/llama_cpp" "$SITE/"
    python3 -c "import cffi, gguf, typer, fastapi; print('python packages ok')"
}

# ggml-cuda links cuBLAS and libcuda. The image's toolkit may lack both (cuBLAS may live only in
# the PyTorch venv's nvidia wheels, libcuda in the driver's mount): put them where CMake looks.
# Runs in this shell (not through step): what it exports must reach the build.
ensure_cuda_libs() {
    local root=$CUDA_ROOT hdr lib driver n
    if [[ ! -w $root/include ]]; then # a read-only toolkit: work on a copy
        cp -rL "$root/." /tmp/cuda && root=/tmp/cuda
    fi
    export CUDACXX=$root/bin/nvcc CUDAToolkit_ROOT=$root PATH=$root/bin:$PATH
    if [[ ! -f $root/include/cublas_v2.h ]]; then
        hdr=$(find / \( -path /proc -o -path /sys -o -path /dev -o -path "$root" \) -prune \
            -o -name cublas_v2.h -print -quit 2>/dev/null)
        if [[ -z $hdr ]]; then echo "no cublas_v2.h here: ggml-cuda cannot build" && return 1; fi
        lib=$(find "$(dirname "$(dirname "$hdr")")" -name 'libcublas.so*' -print -quit)
        cp -n "$(dirname "$hdr")"/cublas*.h "$root/include/"
        cp -an "$(dirname "$lib")"/libcublas*.so* "$root/lib64/"
        echo "cuBLAS from $(dirname "$hdr") and $(dirname "$lib")"
    fi
    for n in cublas cublasLt; do
        if [[ ! -e $root/lib64/lib$n.so ]]; then
            ln -s "$(cd "$root/lib64" && ls lib$n.so.* | head -1)" "$root/lib64/lib$n.so"
        fi
    done
    if [[ ! -e $root/lib64/libcuda.so && ! -e $root/lib64/stubs/libcuda.so ]]; then
        driver=$(ldconfig -p | awk '/libcuda\.so\.1 /{print $NF; exit}')
        driver=${driver:-$(find /usr/local/nvidia /usr/lib* -name libcuda.so.1 -print -quit)}
        ln -s "$driver" "$root/lib64/libcuda.so" && echo "libcuda from $driver"
    fi
    export LD_LIBRARY_PATH=$root/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
}

# The build made by tools/prebuild_gpu.sh (llama.cpp's, unpatched), when carried and staged and
# made from what this checkout would build: unpacked into $BUILD_GGML, checked to load here, and
# lucepy runs on it too (it has no lucepy kernels: ggml's run); GPU_RUN_KERNELS still builds
# lucepy's. Runs in this shell: what it exports must reach the steps.
unpack_prebuilt() {
    unpack_lucepy
    [[ -f .gpubuild/STAMP ]] || return 0
    if [[ ! -f $BUILD_GGML/PREBUILT ]]; then # not unpacked by an earlier run on this machine
        [[ ! -x $BUILD_GGML/llama-bench ]] || return 0 # built here: keep that
        unpacked_build ggml "$BUILD_GGML" || return 0
        cp .gpubuild/STAMP "$BUILD_GGML/PREBUILT"
    fi
    if [[ -z ${GPU_RUN_KERNELS:-} ]]; then # no lucepy kernels there: their tests stay out
        export BUILD=$BUILD_GGML LUCEPY_GGML_LIB=$BUILD_GGML NO_OWN_KERNELS=1
        echo "lucepy and llama.cpp both run on the prebuilt $BUILD_GGML"
    fi
}

# the kernels' sources that lucepy's build in $BUILD was made from (its KERNEL_SOURCES)
kernel_sources() {
    cat vendor/ggml/cuda/* vendor/ggml/recipes.toml | sha256sum | cut -c1-16
}

# lucepy's own build from tools/prebuild_gpu.sh (PREBUILD_KERNELS=lucepy, carried as .lpbuild
# and its staged parts) unpacked into $BUILD where its stamp (the recipes, the kernels' sources,
# the build flags) is this checkout's, and not there already: build_cuda then reuses it
unpack_lucepy() {
    [[ -f .lpbuild/STAMP ]] || return 0
    local sources
    sources=$(kernel_sources)
    if [[ $(cat "$BUILD/KERNEL_SOURCES" 2>/dev/null) == "$sources" ]]; then return 0; fi
    unpacked_build lucepy "$BUILD" || return 0
    echo "$sources" >"$BUILD/KERNEL_SOURCES"
}

# tools/prebuild_gpu.sh's build of KIND (ggml, lucepy) unpacked into DIR, its prefix, where it
# loads; else says so, leaves nothing there and fails (the build step then builds it here)
unpacked_build() {
    local kind=$1 dir=$2
    PREBUILD_KERNELS=$kind bash tools/prebuild_gpu.sh unpack "$(dirname "$dir")" || {
        echo "(building $kind's here instead)" && return 1
    }
    if ldd "$dir"/lib*.so "$dir"/llama-* | grep 'not found'; then
        echo "the prebuilt $kind libraries do not load here (building here instead)"
        rm -rf "$dir"
        return 1
    fi
}

# Two builds of one source tree: lucepy's (its kernels hooked in) into $BUILD, then llama.cpp's
# (unpatched, with llama-bench and llama-quantize) into $BUILD_GGML; the second recompiles only
# the files the patch touches.
build_cuda() {
    local src=/tmp/lucepy-sdist/$NAME ggml=1 ours=0 theirs=1
    if [[ $SKIP == *" build-ggml "* ]]; then ggml=0; fi # lucepy's build only: no llama.cpp steps
    local tools=()
    if [[ $LLAMA_BIN == "$BUILD" ]]; then tools=(--with-llama-bench); fi
    # lucepy's build is reused on a warm machine only if it was made from these kernel sources
    local sources
    sources=$(kernel_sources)
    if [[ -f $BUILD/libggml-cuda.so && $(cat "$BUILD/KERNELS" 2>/dev/null) == lucepy ]] &&
        [[ $(cat "$BUILD/KERNEL_SOURCES" 2>/dev/null) == "$sources" ]] &&
        [[ -z ${tools[*]} || -x $BUILD/llama-quantize ]]; then
        ours=1
    elif [[ $BUILD == "$BUILD_GGML" && -f $BUILD/libggml-cuda.so ]]; then
        ours=1 # lucepy on llama.cpp's build (unpack_prebuilt)
    fi
    if ((ggml)) && [[ ! -x $BUILD_GGML/llama-bench || ! -f $BUILD_GGML/libllama.so ]]; then
        theirs=0
    fi
    if ((ours && theirs)); then echo "reusing the builds" && return 0; fi
    if [[ ! -d .sdist ]]; then
        echo "no .sdist to build from: carry it, or a prebuilt .gpubuild or .lpbuild from" \
            "tools/prebuild_gpu.sh with its other parts staged first (setup.log says which)" &&
            return 1
    fi
    # a copy outside any git checkout (ggml's CMake would stamp an enclosing repo's commit), with
    # its times kept, so that a resumed build recompiles nothing
    if [[ ! -d $src ]]; then
        mkdir -p /tmp/lucepy-sdist && cp -a ".sdist/$NAME" /tmp/lucepy-sdist/
    fi
    # configure wants vendor/miniaudio (only mtmd compiles it): carried in server-ui.tar.xz
    if [[ ! -d $src/vendor/llama.cpp/vendor/miniaudio ]]; then
        tar -xJf .sdist/server-ui.tar.xz -C "$src/vendor/llama.cpp" vendor/miniaudio || return 1
    fi
    if ((!ours)); then
        python3 -m lucepy -v backends build cuda --arch 90 --sdist "$src" "${tools[@]}" || return 1
        echo "$sources" >"$BUILD/KERNEL_SOURCES"
    fi
    if ((ggml && !theirs)); then
        python3 -m lucepy -v backends build cuda --arch 90 --sdist "$src" --kernels ggml \
            --with-llama-bench --prefix "$BUILD_GGML" || return 1
    fi
    ls -la "$BUILD" "$BUILD_GGML" || true
}

# llama-server for GPU_RUN_BATCH: the unpatched build's tree (LUCEPY_BUILD_DIR, left unpatched by
# build_cuda) configured again with the server on, its sources from .sdist/server-ui.tar.xz
build_llama_server() {
    local src=/tmp/lucepy-sdist/$NAME/vendor/llama.cpp tree=$LUCEPY_BUILD_DIR/build
    local f
    if [[ -x $BUILD_GGML/llama-server ]]; then
        echo "reusing $BUILD_GGML/llama-server" && return 0
    fi
    if [[ ! -f .sdist/server-ui.tar.xz ]]; then
        echo "no .sdist/server-ui.tar.xz: run tools/prepare_gpu_carry.sh" && return 1
    fi
    tar -xJf .sdist/server-ui.tar.xz -C "$src"
    cmake -S "$src" -B "$tree" -DLLAMA_BUILD_SERVER=ON >/dev/null
    cmake --build "$tree" -j "$(nproc)" --target llama-server
    for f in "$tree"/bin/llama-server "$tree"/bin/lib*.so*; do # what the build dir lacks
        [[ -e $BUILD_GGML/$(basename "$f") ]] || cp -a "$f" "$BUILD_GGML"/
    done
    if ldd "$BUILD_GGML/llama-server" | grep "not found"; then return 1; fi
    echo "built $BUILD_GGML/llama-server"
}

generate_model() {
    if [[ -f $MODEL ]]; then echo "reusing $MODEL" && return 0; fi
    python3 -m lucepy.testing.big "$MODEL.part" --arch "$ARCH" --type q4_0 --layers "$LAYERS" \
        --threads 4
    mv "$MODEL.part" "$MODEL"
}

# wait_job PID LOG FILE: a job this script started in the background (PID; 0: none) ended, its
# LOG shown, and whether it left FILE
wait_job() {
    while (($1)) && kill -0 "$1" 2>/dev/null; do sleep 1; done
    cat "$2"
    test -f "$3"
}

# the Q4_0 model requantized to $QUANT into $MODEL_K, once the generator (GEN_PID) has written it
# (niced: the GPU tests running beside it come first)
requantize_model() {
    test -f "$MODEL_K" && echo "reusing $MODEL_K" && return 0
    wait_job "$GEN_PID" /dev/null "$MODEL" || { echo "no $MODEL to requantize" && return 1; }
    nice -n 10 "$LLAMA_BIN/llama-quantize" --allow-requantize "$MODEL" "$MODEL_K.part" "$QUANT" 16 &&
        mv "$MODEL_K.part" "$MODEL_K"
}

# lucepy's CPU kernels (vendor/ggml/cpu, which pip compiles where lucepy is installed; here it
# runs from the source tree): built in place, then whether they match this build's ggml-cpu bits
build_cpu_kernels() {
    python3 setup.py -q build_ext --inplace
    python3 -c "from lucepy.ggml import cpu, load; from lucepy.runtime.devices import open_backend
lib = load(); found = cpu.kernels(lib, open_backend(lib, 'cpu'))
print('cpu kernels:', {cpu.KINDS[t][0]: k.variant for t, k in found.items()}, cpu.why_not())"
}

export -f build_cuda kernel_sources build_llama_server wait_job build_cpu_kernels

# --- the run ---
say "gpu_run: into $OUTDIR; model $MODEL; deadline ${DEADLINE}s"
check_gpuref quick
if [[ -n ${GPU_RUN_BATCH:-} && ! -d .whl-batch ]]; then
    stop "GPU_RUN_BATCH needs the official client's wheels: run tools/prepare_gpu_carry.sh here," \
        "then carry .whl-batch beside .whl"
fi
{ nvidia-smi; python3 --version; nproc; free -g; df -h /tmp; } >>"$SETUP" 2>&1 || true
inline wheels "$SETUP" install_wheels || true
check_gpuref full
inline cuda-libs "$SETUP" ensure_cuda_libs || true
inline prebuilt "$SETUP" unpack_prebuilt || true

export GEN_PID=0
if [[ $SKIP != *" model "* ]]; then
    generate_model >/tmp/lucepy-model.log 2>&1 &
    GEN_PID=$!
fi
built=0
step build 480 "$OUTDIR/build.log" build_cuda && built=1
export QUANT=${GPU_RUN_REQUANT:-Q4_K_M}
export MODEL_K=${MODEL%-q4_0.gguf}-${QUANT,,}.gguf REQ_PID=0
if ((built)) && [[ -n ${GPU_RUN_KERNELS:-} && $SKIP != *" requantize "* ]]; then
    requantize_model >/tmp/lucepy-requant.log 2>&1 &
    REQ_PID=$!
fi
step devices 30 "$SETUP" python3 -m lucepy devices --json || true
step cpu-kernels 60 "$SETUP" build_cpu_kernels || true
if ((built)); then
    tests=${GPU_RUN_TESTS:-$(grep -l 'mark\.gpu' tests/test_*.py | tr '\n' ' ')}
    on=${GPU_RUN_TEST_KERNELS:-}
    if [[ -n ${NO_OWN_KERNELS:-} ]]; then # the prebuilt build: ggml's kernels only
        tests=${tests//tests\/test_gpu_kernels.py/} on=0
    fi
    # with lucepy's kernels as a user gets them (unset: on for compute capability 9.0 and newer),
    # or forced on (1) or off (0) by GPU_RUN_TEST_KERNELS
    # shellcheck disable=SC2086
    step pytest "${GPU_RUN_TEST_BUDGET:-240}" "$OUTDIR/pytest.txt" env ${on:+LUCEPY_CUDA_KERNELS=$on} \
        python3 -m pytest -m gpu $tests -v -rfEs -p no:cacheprovider || true
fi
step model 240 "$SETUP" wait_job "$GEN_PID" /tmp/lucepy-model.log "$MODEL" || true

if ((built)) && [[ -n ${GPU_RUN_DFLASH:-} ]]; then # SmolLM2 staged by tools/gpu_train.sh
    step dflash 360 "$BENCHLOG" sh -c "bash tools/gpu_train.sh model && \
        bash tools/build_llama_dflash.sh '$BUILD_GGML' '$SOURCES/$NAME' && \
        exec python3 tools/bench_dflash.py --model /tmp/lucepy-smol/model.gguf --device $DEVICE \
        --llama-dflash '$BUILD_GGML/llama-dflash' --json '$OUTDIR/dflash.json' \
        --md '$OUTDIR/dflash.md'" || true
    if [[ $GPU_RUN_DFLASH == ggml ]]; then # the same on ggml's kernels, lucepy's side only
        step dflash-ggml 240 "$BENCHLOG" env LUCEPY_CUDA_KERNELS=0 python3 tools/bench_dflash.py \
            --model /tmp/lucepy-smol/model.gguf --device "$DEVICE" --temperature 0 \
            --json "$OUTDIR/dflash-ggml.json" --md "$OUTDIR/dflash-ggml.md" || true
    fi
fi

if ((built)) && [[ -f $MODEL && -n ${GPU_RUN_BATCH:-} ]]; then # continuous batching
    server=() sides=() prep=true
    if step llama-server 240 "$OUTDIR/build.log" build_llama_server; then
        server=(--llama-server "$BUILD_GGML/llama-server")
    fi
    # "engine" and "batched-bench" in GPU_RUN_SKIP leave those sides out (servers only)
    if [[ $SKIP == *" engine "* ]]; then sides+=(--no-engine); fi
    if [[ $SKIP != *" batched-bench "* ]]; then
        prep="bash tools/build_llama_dflash.sh --batched-bench '$BUILD_GGML' '$SOURCES/$NAME'"
        sides+=(--llama-batched-bench "'$BUILD_GGML/llama-batched-bench'")
    fi
    step batch 540 "$BENCHLOG" sh -c "$prep && exec python3 tools/bench_batch.py \
        --model '$MODEL' --device $DEVICE --clients '$GPU_RUN_BATCH' --max-ctx 512 \
        ${server[*]} ${sides[*]} --json '$OUTDIR/batch.json' --md '$OUTDIR/batch.md'" || true
fi

if ((built)) && [[ -f $MODEL && -n ${GPU_RUN_KERNELS:-} ]]; then # issue 19
    kernels_bench() { # kernels_bench MODEL TAG: llama-bench ($LLAMA_BUILD), then lucepy both ways
        step "llama-$2" 120 "$BENCHLOG" sh -c "exec env $LLAMA_OFF '$LLAMA_BIN/llama-bench' \
            -m '$1' -ngl 99 -fa 1 -p 512 -n 128 -r 5 -o json >'$OUTDIR/llama-bench-$2.json'" ||
            true
        step "kernels-$2" 500 "$BENCHLOG" python3 tools/bench_kernels.py measure "$1" \
            --device "$DEVICE" --json "$OUTDIR/kernels-$2.json" || true
        if [[ -f $OUTDIR/kernels-$2.json ]]; then
            python3 tools/bench_kernels.py report "$OUTDIR/kernels-$2.json" \
                --llama-bench "$OUTDIR/llama-bench-$2.json" --llama-build "$LLAMA_BUILD" \
                >>"$OUTDIR/kernels.md" 2>&1 || true
        fi
    }
    # (before any benchmark: none shares the CPU with llama-quantize)
    step requantize 240 "$BENCHLOG" wait_job "$REQ_PID" /tmp/lucepy-requant.log "$MODEL_K" || true
    if ((REQ_PID)); then # (a wait that timed out: llama-quantize and its shell)
        pkill -P "$REQ_PID" 2>/dev/null || true
        kill "$REQ_PID" 2>/dev/null || true
    fi
    kernels_bench "$MODEL" q4_0
    if [[ -n ${GPU_RUN_AB:-} ]]; then # one switch of lucepy's kernels both ways, in turn
        step ab 300 "$BENCHLOG" python3 tools/bench_kernels.py ab "$MODEL" --device "$DEVICE" \
            --switch "$GPU_RUN_AB" --json "$OUTDIR/ab.json" --md "$OUTDIR/ab.md" || true
    fi
    for choice in 1 0; do
        step "trace-$choice" 90 "$OUTDIR/trace.txt" env LUCEPY_CUDA_KERNELS=$choice python3 \
            tools/trace_gpu.py trace "$MODEL" --device "$DEVICE" \
            --sequence "$OUTDIR/decode-seq$choice.txt" \
            --json "$OUTDIR/trace-kernels$choice.json" || true
        if [[ -n ${GPU_RUN_TRACE_VERIFY:-} ]]; then # a K-token verify's kernels too
            step "trace-v$choice" 90 "$OUTDIR/trace.txt" env LUCEPY_CUDA_KERNELS=$choice \
                python3 tools/trace_gpu.py trace "$MODEL" --device "$DEVICE" \
                --verify "$GPU_RUN_TRACE_VERIFY" --sequence "$OUTDIR/verify-seq$choice.txt" \
                --json "$OUTDIR/trace-verify$choice.json" || true
            # what the verify spends beyond a decode, kernel by kernel (shares of the span)
            if [[ -f $OUTDIR/trace-kernels$choice.json && -f $OUTDIR/trace-verify$choice.json ]]
            then
                python3 tools/trace_gpu.py path "$OUTDIR/trace-kernels$choice.json" \
                    "$OUTDIR/trace-verify$choice.json" --md "$OUTDIR/path$choice.md" \
                    >>"$OUTDIR/trace.txt" 2>&1 || true
                python3 tools/trace_gpu.py layers "$OUTDIR/decode-seq$choice.txt" \
                    "$OUTDIR/verify-seq$choice.txt" --md "$OUTDIR/layers$choice.md" \
                    >>"$OUTDIR/trace.txt" 2>&1 || true
            fi
        fi
    done
    if [[ -f $MODEL_K ]]; then kernels_bench "$MODEL_K" "${QUANT,,}"; fi
fi

THREADS=${GPU_RUN_THREADS:-8}
NCMOE=$((LAYERS / 2))
if ((built)) && [[ -f $MODEL && $ARCH == qwen35moe ]]; then
    step llama 200 "$BENCHLOG" sh -c "'$BUILD_GGML/llama-bench' -m '$MODEL' -ngl 99 -fa 1 \
        -t $THREADS -p 512 -n 128 -r 3 -o json >'$OUTDIR/llama-bench.json' && \
        exec '$BUILD_GGML/llama-bench' \
        -m '$MODEL' -ngl 99 -fa 1 -t $THREADS -ncmoe $NCMOE -p 0 -n 128 -r 5 -o json \
        >'$OUTDIR/llama-bench-ncmoe.json'" || true
    step lucepy 330 "$BENCHLOG" python3 tools/bench_moe.py measure "$MODEL" --device "$DEVICE" \
        --n-cpu-moe $NCMOE --threads "$THREADS" --json "$OUTDIR/lucepy-bench.json" || true
elif ((built)) && [[ -f $MODEL ]]; then
    if [[ -n ${GPU_RUN_KVPOOL:-} ]]; then # KV Flash: llama-bench, full cache and pool by depth
        step kvpool 540 "$BENCHLOG" python3 tools/bench_kvpool.py measure "$MODEL" \
            --device "$DEVICE" --gpu "${DEVICE#cuda:}" --llama-bench "$BUILD_GGML/llama-bench" \
            --depths "$GPU_RUN_KVPOOL" --pool "${GPU_RUN_POOL:-4096}" \
            --json "$OUTDIR/kvpool.json" || true
    fi
    step llama 150 "$BENCHLOG" sh -c "exec '$BUILD_GGML/llama-bench' -m '$MODEL' -ngl 99 -fa 1 \
        -p 16,512,4096 -n 128 -d 0,$DEPTH -r 3 -o json >'$OUTDIR/llama-bench.json'" || true
    step lucepy 200 "$BENCHLOG" python3 tools/bench_gpu.py measure "$MODEL" --device "$DEVICE" \
        --depth $DEPTH --json "$OUTDIR/lucepy-bench.json" || true
    if [[ -n ${GPU_RUN_HOST:-} ]]; then # where a decode's and a verify's host time goes
        step host 120 "$BENCHLOG" python3 tools/host_time.py "$MODEL" --device "$DEVICE" \
            --json "$OUTDIR/host.json" || true
    fi
    if [[ -n ${GPU_RUN_STACK:-} ]]; then # the same without stacked products (decision 2)
        step lucepy-unstacked 200 "$BENCHLOG" env LUCEPY_STACK_MATMULS=0 python3 \
            tools/bench_gpu.py measure "$MODEL" --device "$DEVICE" --depth $DEPTH \
            --json "$OUTDIR/lucepy-unstacked.json" || true
    fi
    step profile 60 "$BENCHLOG" python3 tools/profile_gpu.py "$MODEL" --device "$DEVICE" \
        --depth 16 || true
    if [[ -n ${GPU_RUN_DIAG:-} ]]; then # diagnostics: a minute or two more
        # the same with ggml-cuda's CUDA graphs off, on both sides: what they are worth here
        step profile-nographs 60 "$BENCHLOG" env GGML_CUDA_DISABLE_GRAPHS=1 python3 \
            tools/profile_gpu.py "$MODEL" --device "$DEVICE" --depth 16 || true
        step llama-nographs 60 "$BENCHLOG" sh -c "'$BUILD_GGML/llama-bench' -m '$MODEL' -ngl 99 \
            -fa 1 -p 0 -n 128 -r 3 && GGML_CUDA_DISABLE_GRAPHS=1 exec '$BUILD_GGML/llama-bench' \
            -m '$MODEL' -ngl 99 -fa 1 -p 0 -n 128 -r 3" || true
        step trace 60 "$OUTDIR/trace.txt" python3 tools/trace_gpu.py trace "$MODEL" \
            --device "$DEVICE" --json "$OUTDIR/trace.json" || true
        # every kernel of a few decode tokens, one at a time, under Nsight Compute: lucepy's, then
        # llama-bench's (tg of 3 after its warm-up token); tools/trace_gpu.py compare reads both
        NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || true)
        NCU_ARGS=(--csv --metrics gpu__time_duration.sum --graph-profiling node
            --cache-control none --clock-control none --print-kernel-base demangled)
        if [[ -n $NCU ]]; then
            step ncu-lucepy 120 "$BENCHLOG" "$NCU" "${NCU_ARGS[@]}" --log-file /tmp/ncu-lucepy.csv \
                python3 tools/trace_gpu.py steps "$MODEL" --device "$DEVICE" || true
            step ncu-llama 120 "$BENCHLOG" "$NCU" "${NCU_ARGS[@]}" --log-file /tmp/ncu-llama.csv \
                "$BUILD_GGML/llama-bench" -m "$MODEL" -ngl 99 -fa 1 -p 0 -n 3 -r 1 || true
            python3 tools/trace_gpu.py compare /tmp/ncu-lucepy.csv /tmp/ncu-llama.csv \
                >>"$OUTDIR/trace.txt" 2>&1 || true
        fi
    fi
fi

if ((built)) && [[ -n ${GPU_RUN_AFTER:-} ]]; then # the caller's command, in this environment
    step after 600 "$BENCHLOG" env OUTDIR="$OUTDIR" bash -c "$GPU_RUN_AFTER" || true
fi

if [[ $ARCH == qwen35moe ]]; then
    python3 tools/bench_moe.py report "$OUTDIR/lucepy-bench.json" --n-cpu-moe $NCMOE \
        --llama-bench "$OUTDIR/llama-bench.json" "$OUTDIR/llama-bench-ncmoe.json" \
        --md "$OUTDIR/summary.md" >/dev/null 2>&1 || true
else
    python3 tools/bench_gpu.py report "$OUTDIR/lucepy-bench.json" --depth $DEPTH \
        --llama-bench "$OUTDIR/llama-bench.json" --md "$OUTDIR/summary.md" >/dev/null 2>&1 || true
fi
if [[ -f $OUTDIR/kvpool.json ]]; then
    { echo; echo '## KV Flash'; echo; python3 tools/bench_kvpool.py report "$OUTDIR/kvpool.json"; } \
        >>"$OUTDIR/summary.md" 2>&1 || true
fi
{
    echo
    echo '## Steps (time used of budget)'
    echo '```'
    printf '%s\n' "${SUMMARY[@]}"
    echo '```'
    echo
    grep -E '^(FAILED|ERROR)|[0-9]+ (passed|failed|skipped|error)' "$OUTDIR/pytest.txt" | tail -20
} >>"$OUTDIR/summary.md" 2>/dev/null || true
cat "$OUTDIR/summary.md"
# The device tool brings back at most 8 files from a call: past that, every file goes into one
# archive, all.tar.gz, beside which only summary.md and kernels.md stay (a call of issue 19's
# benchmark with its traces writes 15, and the traces were the ones left behind)
if (($(find "$OUTDIR" -maxdepth 1 -type f | wc -l) > 8)); then
    tar -czf /tmp/gpu-run-all.tar.gz -C "$OUTDIR" .
    find "$OUTDIR" -maxdepth 1 -type f ! -name summary.md ! -name kernels.md -delete
    mv /tmp/gpu-run-all.tar.gz "$OUTDIR/all.tar.gz"
    say "gpu_run: $OUTDIR/all.tar.gz holds every file (tar -xzf all.tar.gz)"
fi
say "gpu_run: done"

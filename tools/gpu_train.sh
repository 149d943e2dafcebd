#!/usr/bin/env bash
# Train SmolLM2-135M-Instruct's DFlash draft on the GPU machine (tools/train_dflash.py), and stage
# its target there for tools/gpu_dflash.sh.
#
# The target GGUF (98 MB) does not fit one device call's 64 MiB carry beside the repo, so it
# travels in three xz parts, to a machine kept warm between calls:
#   here:      tools/gpu_train.sh split [MODEL.gguf]     -> .smol1/ .smol2/ .smol3/ (git-ignored)
#   calls 1-3: tools/gpu_train.sh stage .smolN           (carry .smolN), one call each
#   call 4:    tools/gpu_train.sh train OUTDIR [ARGS...] (carry .whl-gguf; ARGS go to train_dflash)
# The shipped draft came from rounds of fresh data on warm machines (docs/BENCHMARKS.md,
# sessions 21 and 24, the later rounds from weights staged out of .dflash/): round 1 `train
# /tmp/o1 --sequences 300000 --data-s 170 --train-s 290 --features-gib 0`, then each next round
# `train /tmp/oR --init /tmp/oP/weights.*.npz --seed R-1 --lr 6e-4 ...` from the previous round's
# weights, still in /tmp, on sequences it makes anew.
# Sequences made before (data.json.xz: use --data /tmp/lucepy-smol/data.json; train_dflash makes
# more until there are --sequences, so pass at most what is there to train at once) and weights to go
# on from on another machine (weights.N.npz: --init /tmp/lucepy-smol/weights.N.npz) travel in a
# folder such as .dflash/, staged the same way. OUTDIR gets train.log, train.json, draft.gguf and
# weights.N.npz (f16 parts of at most ~12 MiB that tools/dflash_gguf.py re-writes as a draft here).
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=/tmp/lucepy-smol

case ${1:-} in
split)
    model=${2:-$(python3 -c 'from lucepy.catalog import smollm2_file; print(smollm2_file())')}
    rm -rf .smol1 .smol2 .smol3 .smol && mkdir -p .smol
    xz -T2 -6 -c "$model" | split -b 30M - .smol/part.
    sha256sum "$model" | cut -d' ' -f1 >.smol/sha256
    for i in 1 2 3; do
        grep -qx "/.smol$i/" .git/info/exclude || echo "/.smol$i/" >>.git/info/exclude
        mkdir .smol$i
    done
    mv .smol/part.aa .smol/sha256 .smol1/ && mv .smol/part.ab .smol2/ && mv .smol/part.ac .smol3/
    rmdir .smol && du -sh .smol1 .smol2 .smol3
    ;;
stage) # a carried folder's files into the stage
    mkdir -p $STAGE && cp "${2:?a carried folder such as .smol1}"/* $STAGE/ && ls -la $STAGE
    ;;
model) # the staged parts, checked, as $STAGE/model.gguf
    ls $STAGE/part.a? >/dev/null 2>&1 && [[ -f $STAGE/part.ac ]] || {
        echo "the target's parts are not all staged: run 'stage .smolN' (N = 1..3) on this" \
            "warm machine first" >&2
        exit 2
    }
    [[ -f $STAGE/model.gguf ]] || cat $STAGE/part.a? | xz -d >$STAGE/model.gguf
    echo "$(cat $STAGE/sha256)  $STAGE/model.gguf" | sha256sum -c
    ;;
train)
    out=${2:?OUTDIR}
    shift 2
    mkdir -p "$out"
    bash "$0" model
    # sequences made before (a previous call's OUTDIR/data.json.xz, staged from .dflash/)
    if [[ -f $STAGE/data.json.xz && ! -f $STAGE/data.json ]]; then
        xz -d -c $STAGE/data.json.xz >$STAGE/data.json
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
        .whl-gguf/gguf-*.whl
    export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python3 tools/train_dflash.py $STAGE/model.gguf "$out" "$@" 2>&1 | tee "$out/train.log"
    ;;
*)
    sed -n '2,15p' "$0"
    exit 2
    ;;
esac

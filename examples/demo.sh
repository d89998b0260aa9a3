#!/usr/bin/env bash
# `make demo`: the main job on the bundled corpus — preprocess, pretrain a small GPT-2, generate.
# Usage: demo.sh PYTHON OUTDIR. Uses the GPU when torch sees one, else the CPU (a few minutes).
set -euo pipefail
PY=${1:-python}
OUT=${2:-work/demo}
ITERS=${DEMO_ITERS:-200}
mkdir -p "$OUT"

echo "== 1/4 preprocess data/austen.jsonl (six Jane Austen novels) into Megatron .bin/.idx"
"$PY" -m zerotron preprocess --input data/austen.jsonl --output-prefix "$OUT/austen" \
    --json-keys text --tokenizer-type GPT2BPETokenizer --append-eod --workers 2

echo
echo "== 2/4 dataset statistics and the train/valid/test split"
"$PY" -m zerotron dataset-info --data-path "$OUT/austen_text_document" --split 98,1,1 \
    --seq-length 128

echo
# bf16 where this machine multiplies bf16 matrices fast (GPUs, CPUs with AVX-512 BF16 or AMX),
# fp32 where bf16 is slower (e.g. AVX2-only CPUs): timed once on the model's shapes, cached
# (`zerotron kernels`, docs/kernels.md). DEMO_PRECISION=bf16|fp32 skips the measurement.
SHAPE=(--hidden-size 256 --num-attention-heads 4 --seq-length 128 --micro-batch-size 16)
PRECISION=${DEMO_PRECISION:-$("$PY" -m zerotron kernels "${SHAPE[@]}" --pick-precision)}
case "$PRECISION" in
    bf16) PRECISION_FLAG=--bf16 ;;
    fp32) PRECISION_FLAG= ;;
    *) echo "demo.sh: precision '$PRECISION' is neither bf16 nor fp32" >&2; exit 2 ;;
esac
echo "== 3/4 pretrain a 4-layer GPT-2 (hidden 256) for $ITERS iterations in $PRECISION"
rm -rf "$OUT/ckpt" "$OUT/tensorboard"
# shellcheck disable=SC2086  # PRECISION_FLAG is one word or none
"$PY" -m zerotron pretrain --num-layers 4 "${SHAPE[@]}" \
    --global-batch-size 16 --train-iters "$ITERS" \
    --lr 2e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 10 \
    --weight-decay 0.1 --clip-grad 1.0 --hidden-dropout 0 --attention-dropout 0 $PRECISION_FLAG \
    --data-path "$OUT/austen_text_document" --split 98,1,1 \
    --log-interval 20 --eval-interval 100 --eval-iters 4 \
    --save "$OUT/ckpt" --save-interval 100 --tensorboard-dir "$OUT/tensorboard" \
    2>&1 | tee "$OUT/pretrain.log"

echo
echo "== 4/4 generate from the checkpoint"
"$PY" -m zerotron generate --load "$OUT/ckpt" --prompt "It is a truth universally acknowledged" \
    --max-new-tokens 60 --top-k 40 --temperature 0.8 --seed 1 | tee "$OUT/sample.txt"

echo
echo "Tokenized data: $OUT/austen_text_document.{bin,idx}"
echo "Checkpoint:     $OUT/ckpt/ (latest: $(cat "$OUT/ckpt/latest"))"
echo "Training log:   $OUT/pretrain.log   (TensorBoard: $OUT/tensorboard)"
echo "Sample:         $OUT/sample.txt"

#!/usr/bin/env bash
# `make demo`: the main job on the bundled corpus. Usage: demo.sh PYTHON OUTDIR
set -euo pipefail
PY=${1:-python}
OUT=${2:-work/demo}
mkdir -p "$OUT"

echo "== 1. preprocess data/austen.jsonl (six Jane Austen novels) into Megatron .bin/.idx"
"$PY" -m zerotron preprocess --input data/austen.jsonl --output-prefix "$OUT/austen" \
    --json-keys text --tokenizer-type GPT2BPETokenizer --append-eod --workers 2

echo
echo "== 2. dataset statistics and the train/valid/test split"
"$PY" -m zerotron dataset-info --data-path "$OUT/austen_text_document" --split 949,50,1 \
    --seq-length 256

echo
echo "Tokenized data: $OUT/austen_text_document.{bin,idx}"

#!/usr/bin/env bash
# The picture in docs/report.png: two short runs on the bundled corpus (one stopped at iteration
# 20 and resumed, one in fp16 at a higher learning rate), `zerotron report` of both, and a
# screenshot of the page in headless Chromium (Debian's chromium: `make report-deps`).
#   bash examples/report_example.sh [PYTHON] [WORKDIR]
set -euo pipefail
PY=${1:-.venv/bin/python}
W=${2:-work/report-example}
mkdir -p "$W"
if [ ! -f "$W/austen_text_document.idx" ]; then
  "$PY" -m zerotron preprocess --input data/austen.jsonl --output-prefix "$W/austen" \
      --append-eod --workers 2
fi
common=(--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64
        --micro-batch-size 4 --global-batch-size 4 --train-iters 40 --lr-decay-style cosine
        --lr-warmup-iters 4 --min-lr 1e-4 --split 98,1,1 --log-interval 2 --eval-interval 10
        --eval-iters 1 --save-interval 10 --data-path "$W/austen_text_document")
rm -rf "$W/lr1e-3" "$W/lr3e-3_fp16"
"$PY" -m zerotron pretrain "${common[@]}" --lr 1e-3 --save "$W/lr1e-3" --exit-interval 20
"$PY" -m zerotron pretrain "${common[@]}" --lr 1e-3 --save "$W/lr1e-3" --load "$W/lr1e-3"
"$PY" -m zerotron pretrain "${common[@]}" --lr 3e-3 --fp16 --initial-loss-scale 65536 \
    --save "$W/lr3e-3_fp16"
"$PY" -m zerotron report "$W/lr1e-3" "$W/lr3e-3_fp16" --out "$W/report.html"
chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1500,2250 \
    --user-data-dir="$W/chromium-profile" --screenshot="$W/report.png" "file://$(realpath "$W/report.html")"
echo "page: $W/report.html; screenshot: $W/report.png"

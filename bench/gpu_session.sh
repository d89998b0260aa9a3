#!/usr/bin/env bash
# Issue 18's checks for a lent GPU machine, in one command that fits one device call
# (docs/gpu.md): machine facts, `make test-gpu`, bench/train_step.py on CUDA for GPT-2 124M and
# 1.5B, then, with the time left, the host CPU's fp32 eager column.
#
# Each step has a time limit of its own, cut to what is left of BUDGET seconds (default 560,
# under a device call's 600), so one slow step cannot take the others' time; a step that
# fails does not stop the next. Logs, JSON results and summary.txt (each step's command, exit
# code and seconds) go to $OUT (the device tool brings that folder back) or ./gpu-out: eight
# files at most, the tool's limit.
#
#   bash bench/gpu_session.sh [BUDGET]
#
# zerotron's dependencies the machine's Python lacks (pydantic there) come as wheels in .whl/
# (docs/gpu.md says how to fetch them); they are installed offline into .gpu-site/ first.
set -u

budget=${1:-560}
out=${OUT:-gpu-out}
py=${GPU_PYTHON:-python3}
start=$(date +%s)
mkdir -p "$out"
: >"$out/summary.txt"

left() { echo $((budget - ($(date +%s) - start))); }

# step NAME LIMIT COMMAND...: run COMMAND for at most LIMIT seconds (less if less is left)
step() {
	local name=$1 limit=$2 remaining t0 rc
	shift 2
	remaining=$(left)
	((limit > remaining)) && limit=$remaining
	if ((limit < 30)); then
		echo "$name: skipped, ${remaining}s of the budget left" | tee -a "$out/summary.txt"
		return
	fi
	echo "$name (limit ${limit}s): $*" | tee -a "$out/summary.txt"
	t0=$(date +%s)
	timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
	rc=$?
	echo "  exit code $rc after $(($(date +%s) - t0))s" | tee -a "$out/summary.txt"
	tail -n 30 "$out/$name.log"
}

{
	nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
	"$py" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'
	lscpu | grep -E '^(Model name|CPU\(s\)|Flags)'
} >"$out/machine.txt" 2>&1
cut -c1-300 "$out/machine.txt"

if ls .whl/*.whl >/dev/null 2>&1; then
	"$py" -m pip install -q --no-index --no-deps --no-compile --upgrade --target .gpu-site .whl/*.whl
fi
export PYTHONPATH="$PWD:$PWD/.gpu-site${PYTHONPATH:+:$PYTHONPATH}"

if command -v make >/dev/null; then
	step test-gpu 150 make test-gpu GPU_PYTHON="$py"
else # the Makefile's test-gpu recipe, for an image without make
	step test-gpu 150 env ZEROTRON_GPU_TESTS=1 "$py" -m pytest -q -n 0 -p no:cacheprovider tests/cuda
fi
step train-124m 200 "$py" bench/train_step.py --device cuda --model gpt2-124m \
	--json "$out/train-124m.json"
step train-1.5b 330 "$py" bench/train_step.py --device cuda --model gpt2-1.5b \
	--json "$out/train-1.5b.json"
step cpu-fp32 300 "$py" bench/train_step.py --device cpu --clock cpu --threads 1 \
	--dtypes fp32 --compile off --repeat 2
echo "used $(($(date +%s) - start))s of ${budget}s" | tee -a "$out/summary.txt"

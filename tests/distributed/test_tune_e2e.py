"""``zerotron launch --autotuning run`` end to end on 2 CPU ranks: a DeepSpeed-style script
(tests/distributed/launch_scripts/tune_train.py, a 2-layer MLP of width 64) whose config asks
for ZeRO stages [0, 1] × micro-batches [2, 8]. The tuner profiles the model (DeepSpeed's
model-info run), runs the four experiments as launched jobs that measure themselves, writes
the results, and launches the best, which trains to its end. The best must be the one the
measured metrics say (read from results.csv), and the tuning (profile and experiments) under 3
minutes.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "distributed" / "launch_scripts" / "tune_train.py"
CONFIG = {
    "train_micro_batch_size_per_gpu": [2, 8],
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": [0, 1]},
    "autotuning": {"enabled": True, "start_profile_step": 1, "end_profile_step": 3},
}


@pytest.fixture(scope="module")
def tuned(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, float]:
    root = tmp_path_factory.mktemp("tune")
    (root / "ds.json").write_text(json.dumps(CONFIG))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable, "-m", "zerotron", "launch", "--autotuning", "run",
        "--nproc_per_node", "2", "--experiment_time_limit", "120",
        str(SCRIPT), "--deepspeed_config", "ds.json", "--steps", "4",
    ]  # fmt: skip
    started = time.perf_counter()
    run = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    return run, root / "autotuning_results", time.perf_counter() - started


TUNE = pytest.mark.xdist_group("tune_e2e")


@TUNE
def test_tune_runs_four_experiments_and_writes_the_results(tuned):
    run, results, seconds = tuned
    assert run.returncode == 0, run.stderr[-3000:]
    for name in ("results.csv", "summary.txt", "metric.png", "ds_config_optimal.json",
                 "cmd_optimal.txt"):  # fmt: skip
        assert (results / name).is_file(), name
    rows = list(csv.DictReader((results / "results.csv").open()))
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows), rows
    assert {(r["zero_stage"], r["micro_batch_size"]) for r in rows} == {
        ("0", "2"), ("0", "8"), ("1", "2"), ("1", "8")}  # fmt: skip
    assert json.loads((results / "profile_model_info" / "metrics.json").read_text())[
        "num_params"
    ] == 2 * (64 * 64 + 64)


@TUNE
def test_the_best_is_the_one_the_measured_metrics_say_and_run_launches_it(tuned):
    run, results, _ = tuned
    rows = list(csv.DictReader((results / "results.csv").open()))
    best = max(rows, key=lambda r: float(r["throughput"]))
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert "autotuning" not in optimal
    got = (optimal["zero_optimization"]["stage"], optimal["train_micro_batch_size_per_gpu"])
    assert got == (int(best["zero_stage"]), int(best["micro_batch_size"]))
    assert "ds_config_optimal.json" in (results / "cmd_optimal.txt").read_text()
    assert (
        f"| global | 4 | {float(best['throughput']):.6g} | {best['name']} |"
        in (results / "summary.txt").read_text()
    )
    said = f"tune_train: trained 4 steps, micro-batch {got[1]}, ZeRO stage {got[0]}"
    assert said in run.stdout


@TUNE
def test_tune_takes_under_three_minutes(tuned):
    # the tuner's own clock: the profile and the four experiments (not the best's run)
    text = (tuned[1] / "summary.txt").read_text()
    seconds = float(re.search(r"Tuning completed in ([0-9.]+) s", text)[1])
    assert seconds < 180

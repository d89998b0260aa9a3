"""zerotron.progress: plain lines in a log (exact format), a rich bar on a terminal, and the
commands that use it."""

from __future__ import annotations

import io

from rich.console import Console

from zerotron.progress import Progress, format_seconds


class Clock:
    """A fake monotonic clock: ``now`` is set by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _plain(*args, **kwargs) -> tuple[Progress, io.StringIO, Clock]:
    out, clock = io.StringIO(), Clock()
    return Progress(*args, stream=out, clock=clock, **kwargs), out, clock


def test_format_seconds():
    assert format_seconds(0) == "0:00:00"
    assert format_seconds(61.4) == "0:01:01"
    assert format_seconds(3 * 3600 + 7) == "3:00:07"
    assert format_seconds(None) == "-:--:--"
    assert format_seconds(float("nan")) == "-:--:--"


def test_plain_lines_every_log_seconds_with_counts_and_eta():
    bar, out, clock = _plain("copy", 4, unit="files", log_seconds=10)
    assert not bar.is_bar  # a StringIO is no terminal
    clock.now += 5
    bar.update(1, info="a")  # 5 s after the start: too soon for a line
    clock.now += 7
    bar.update(1, info="b")  # 12 s: a line; 2 of 4 in 12 s leaves 12 s
    clock.now += 3
    bar.update(1)  # 15 s: 3 s after the last line
    clock.now += 5
    bar.close()  # 20 s: the last line; 3 of 4 in 20 s leaves 6.67 s
    assert out.getvalue().splitlines() == [
        "copy: 2/4 files (50%), 0:00:12 elapsed, ETA 0:00:12, b",
        "copy: 3/4 files (75%), 0:00:20 elapsed, ETA 0:00:07, b",
    ]


def test_close_does_not_repeat_the_last_line():
    bar, out, clock = _plain("copy", 2, unit="files", log_seconds=1)
    clock.now += 2
    bar.update(2)
    bar.close()
    bar.close()
    assert out.getvalue() == "copy: 2/2 files (100%), 0:00:02 elapsed, ETA 0:00:00\n"


def test_unknown_total_has_no_percentage_or_eta():
    bar, out, clock = _plain("tokenizing", unit="documents", log_seconds=10)
    clock.now += 5
    bar.update(1234)
    bar.close()
    assert out.getvalue() == "tokenizing: 1,234 documents, 0:00:05 elapsed\n"


def test_eta_counts_only_this_runs_rate():
    """A resumed run (completed=) measures its rate from where it started."""
    bar, out, clock = _plain("training", 100, unit="iterations", completed=50, log_seconds=None)
    assert bar.eta() is None  # no rate yet
    clock.now += 10
    bar.update(10)  # 10 iterations in 10 s, 40 left
    assert bar.eta() == 40.0
    assert bar.line() == "training: 60/100 iterations (60%), 0:00:10 elapsed, ETA 0:00:40"


def test_caller_lines_without_automatic_ones():
    bar, out, clock = _plain("tokenizing", 10, log_seconds=None)
    clock.now += 100
    bar.update(5)
    bar.note("Processed 5 documents.")
    bar.print("a log line")
    bar.close()
    assert out.getvalue() == "Processed 5 documents.\na log line\n"


def test_disabled_prints_nothing():
    bar, out, clock = _plain("training", 10, enabled=False, log_seconds=1)
    clock.now += 5
    bar.update(5)
    bar.print("rank 1's line")
    bar.note("a note")
    bar.close()
    assert out.getvalue() == ""


def test_terminal_draws_a_bar_with_eta_and_prints_lines_above_it():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120, color_system=None)
    clock = Clock()
    bar = Progress("copy", 4, unit="files", console=console, clock=clock)
    assert bar.is_bar
    bar.update(2, info="shard-1")
    bar.note("only for logs")  # the bar already shows it
    bar.print("a log line")
    bar.close()
    text = out.getvalue()
    assert "a log line" in text and "only for logs" not in text
    last = text.rsplit("\r", 1)[-1]  # the bar as finally drawn
    for part in ("copy", "━", "50%", "2/4 files", "shard-1", "ETA"):
        assert part in last, (part, last)


def test_convert_reports_its_steps_on_stderr(tmp_path, capsys):
    """zerotron convert (reshard): read, one split per target rank, write -> 2 + tp*pp steps."""
    import torch

    from zerotron.checkpoint.convert import main as convert
    from zerotron.checkpoint.model import save_gpt
    from zerotron.models.gpt import GPT, GPTConfig

    config = GPTConfig(
        num_layers=2, hidden_size=8, num_attention_heads=2, seq_length=8,
        max_position_embeddings=8, vocab_size=128, orig_vocab_size=120,
    )  # fmt: skip
    torch.manual_seed(0)
    save_gpt(tmp_path / "src", config, GPT(config).state_dict(), tag="release")
    convert([
        "--load", str(tmp_path / "src"), "--save", str(tmp_path / "out"),
        "--target-tensor-parallel-size", "2", "--make-vocab-size-divisible-by", "8",
    ])  # fmt: skip
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("convert: 4/4 steps (100%), "), err
    assert ", ETA 0:00:00, wrote " in err[0]


def test_zero_to_fp32_counts_the_zero_files_read(tmp_path, capsys):
    """zerotron zero-to-fp32: one step per ZeRO file (2 model-parallel ranks x dp 2 = 4)."""
    from tests.test_zero_to_fp32 import toy_params, write_zero_checkpoint
    from zerotron.cli import main

    by_mp = {(tp, 0): toy_params(seed=tp) for tp in range(2)}
    write_zero_checkpoint(tmp_path / "c", by_mp, dp=2)
    assert main(["zero-to-fp32", str(tmp_path / "c"), str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("zero-to-fp32: 4/4 files (100%), "), err
    assert err[0].endswith(", ETA 0:00:00, zero_dp_rank_1_mp_rank_01_000_optim_states.pt")

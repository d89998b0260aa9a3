"""zero-to-fp32 from synthetic ZeRO files written in the layout format directly (no processes):
the consolidated tensors equal the known fp32 ones exactly, in every output format; tied
weights are stored once; incomplete or mixed saves are refused; memory stays below the output.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file as load_safetensors

from zerotron.checkpoint import build_metadata, layout, load_file, save_checkpoint
from zerotron.checkpoint.model import load_gpt
from zerotron.checkpoint.zero_to_fp32 import (
    SHARED_PARAMS_KEY,
    get_fp32_state_dict_from_zero_checkpoint,
    zero_to_fp32,
)
from zerotron.cli import main as cli_main
from zerotron.errors import CheckpointError
from zerotron.models.gpt import GPT, GPTConfig


def zero_states(params: dict[str, torch.Tensor], dp: int, sub_group_size: int = 40) -> list[dict]:
    """The N per-rank ZeRO states of ``params`` in the contract's layout.

    Each parameter is split into ``ceil(n / dp)`` chunks; rank r's chunks are packed into fp32
    partitions of at most ``sub_group_size`` elements, zero padding included; the padding is
    filled with NaN here so that reading it would show.
    """
    states = []
    for r in range(dp):
        parts: list[list[torch.Tensor]] = [[]]
        used = [0]
        entries = []
        for name, p in params.items():
            n = p.numel()
            chunk = math.ceil(n / dp)
            start = r * chunk
            length = max(0, min(chunk, n - start))
            piece = torch.full((chunk,), float("nan"))
            piece[:length] = p.reshape(-1)[start : start + length].float()
            if used[-1] and used[-1] + chunk > sub_group_size:
                parts.append([])
                used.append(0)
            entries.append(
                {
                    "name": name,
                    "shape": list(p.shape),
                    "numel": n,
                    "chunk": chunk,
                    "start": start,
                    "length": length,
                    "partition": len(parts) - 1,
                    "offset": used[-1],
                }
            )
            parts[-1].append(piece)
            used[-1] += chunk
        fp32 = [torch.cat(ps) for ps in parts]
        states.append(
            {
                "zero_stage": 2,
                "dp_rank": r,
                "dp_size": dp,
                "optimizer": {
                    "state": {
                        i: {"exp_avg": f.clone(), "step": torch.tensor(3.0)}
                        for i, f in enumerate(fp32)
                    },
                    "param_groups": [{"lr": 1e-3, "params": list(range(len(fp32)))}],
                },
                "fp32_partitions": fp32,
                "layout": entries,
                "grad_scaler": None,
                "num_skipped_steps": 0,
            }
        )
    return states


def write_zero_checkpoint(
    root: Path,
    params_by_mp: dict[tuple[int, int], dict[str, torch.Tensor]],
    dp: int,
    *,
    model_states: dict[tuple[int, int], dict] | None = None,
    metadata: dict | None = None,
    tag: str = "global_step7",
) -> Path:
    """A checkpoint as the Engine writes it under ZeRO: zero files + model files + trackers."""
    pp_size = max(pp for _, pp in params_by_mp) + 1
    files = {}
    for (tp, pp), params in params_by_mp.items():
        for r, st in enumerate(zero_states(params, dp)):
            files[layout.zero_file(r, tp, pp)] = st
        if model_states is not None:
            files[layout.model_file(tp, pp, pp_size)] = model_states[(tp, pp)]
    meta = metadata or {"layout": {"pipeline_model_parallel_size": pp_size}}
    return save_checkpoint(root, tag, files, meta)


def toy_params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"embed.weight": (11, 5), "block.w": (7, 3), "block.b": (7,), "head.scale": (1,)}
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def toy_model_state(params: dict[str, torch.Tensor]) -> dict:
    """The model file: 16-bit copies, a tied alias, a buffer and a frozen parameter."""
    model = {k: v.to(torch.bfloat16) for k, v in params.items()}
    model["lm_head.weight"] = model["embed.weight"]  # tied: the same tensor under two names
    model["block.mask"] = torch.tensor([True, False, True])  # a buffer
    model["frozen.w"] = torch.arange(6, dtype=torch.bfloat16).view(2, 3)  # not in the optimizer
    return {"model": model, SHARED_PARAMS_KEY: {"lm_head.weight": "embed.weight"}}


def test_rebuilds_every_fp32_tensor_exactly_in_memory_and_as_safetensors(tmp_path):
    params = toy_params()
    model_state = toy_model_state(params)
    write_zero_checkpoint(
        tmp_path / "ckpt", {(0, 0): params}, dp=3, model_states={(0, 0): model_state}
    )

    sd = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")  # tag from `latest`
    assert list(sd) == list(model_state["model"])  # state-dict order, aliases included
    for name, p in params.items():
        assert sd[name].dtype == torch.float32 and torch.equal(sd[name], p), name
    assert sd["lm_head.weight"] is sd["embed.weight"]
    assert torch.equal(sd["block.mask"], model_state["model"]["block.mask"])
    assert torch.equal(sd["frozen.w"], model_state["model"]["frozen.w"])

    out = tmp_path / "model.safetensors"
    assert zero_to_fp32(tmp_path / "ckpt", out) == [out]
    loaded = load_safetensors(out)
    assert set(loaded) == set(params) | {"block.mask", "frozen.w"}  # the alias is stored once
    for name, p in params.items():
        assert loaded[name].dtype == torch.float32 and torch.equal(loaded[name], p), name
    assert loaded["frozen.w"].dtype == torch.bfloat16
    with safe_open(str(out), "pt") as f:
        assert json.loads(f.metadata()["shared"]) == {"lm_head.weight": "embed.weight"}
    assert not list(tmp_path.glob(".*tmp*"))  # the temporary file was renamed into place

    # A tag directory works as well as the save root, and --tag picks an older tag.
    assert torch.equal(
        get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt" / "global_step7")["block.w"],
        params["block.w"],
    )


@pytest.mark.parametrize("dp", [1, 2, 4, 16])  # 16 > numel of some params: empty chunks
def test_any_data_parallel_size_without_a_model_file(tmp_path, dp):
    params = toy_params(seed=dp)
    write_zero_checkpoint(tmp_path, {(0, 0): params}, dp=dp, tag="t")
    out = tmp_path / "o.safetensors"
    zero_to_fp32(tmp_path, out, tag="t")
    loaded = load_safetensors(out)
    assert list(loaded) == list(params)
    assert all(torch.equal(loaded[k], v) for k, v in params.items())


def test_model_parallel_ranks_give_one_file_each(tmp_path):
    by_mp = {(tp, pp): toy_params(seed=10 * pp + tp) for pp in range(2) for tp in range(2)}
    write_zero_checkpoint(tmp_path / "c", by_mp, dp=2)
    paths = zero_to_fp32(tmp_path / "c", tmp_path / "out")
    names = sorted(p.name for p in paths)
    assert names == [f"mp_rank_{t:02d}_{p:03d}.safetensors" for t in range(2) for p in range(2)]
    for (tp, pp), params in by_mp.items():
        loaded = load_safetensors(tmp_path / "out" / f"mp_rank_{tp:02d}_{pp:03d}.safetensors")
        assert all(torch.equal(loaded[k], v) for k, v in params.items())
        sd = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "c", tp_rank=tp, pp_rank=pp)
        assert all(torch.equal(sd[k], v) for k, v in params.items())


def test_megatron_output_loads_as_a_gpt_through_the_cli(tmp_path):
    config = GPTConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=8,
        max_position_embeddings=8,
        vocab_size=128,
        orig_vocab_size=100,
    )
    torch.manual_seed(0)
    model = GPT(config)
    fp32 = {n: p.detach().clone() for n, p in model.named_parameters()}
    model_state = {
        "model": {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()},
        SHARED_PARAMS_KEY: {},
    }
    meta = build_metadata(
        model_config=config.to_dict(),
        vocab_size=100,
        padded_vocab_size=128,
        data_parallel_size=2,
        zero_stage=3,
        params_dtype="bf16",
    )
    write_zero_checkpoint(
        tmp_path / "c",
        {(0, 0): fp32},
        dp=2,
        model_states={(0, 0): model_state},
        metadata=meta,
        tag="iter_0000005",
    )

    assert (
        cli_main(["zero-to-fp32", str(tmp_path / "c"), str(tmp_path / "m"), "--format", "megatron"])
        == 0
    )
    loaded, got_meta = load_gpt(tmp_path / "m")  # what `zerotron generate --load` does
    assert got_meta["layout"]["zero_stage"] == 0 and got_meta["params_dtype"] == "fp32"
    assert (tmp_path / "m" / "latest").read_text().strip() == "release"
    for name, p in loaded.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, fp32[name]), name
    assert set(load_file(tmp_path / "m", "release", layout.model_file())) == {
        "model",
        "checkpoint_version",
    }  # no optimizer


def test_missing_or_mixed_files_are_refused(tmp_path):
    params = toy_params()
    tag_dir = write_zero_checkpoint(tmp_path / "a", {(0, 0): params}, dp=3)
    (tag_dir / layout.zero_file(1)).unlink()
    with pytest.raises(
        CheckpointError, match=r"zero_dp_rank_1_mp_rank_00_000_optim_states.pt: missing"
    ):
        zero_to_fp32(tmp_path / "a", tmp_path / "x.safetensors")

    # rank 1 of a 3-rank save next to ranks 0 and 2 of another one with other chunking
    tag_b = write_zero_checkpoint(tmp_path / "b", {(0, 0): params}, dp=3)
    other = zero_states(params, dp=3, sub_group_size=1000)[1]
    other["layout"][0]["start"] += 1
    torch.save(other, tag_b / layout.zero_file(1))
    meta = json.loads((tag_b / "metadata.json").read_text())
    del meta["checksums"]  # saved before checksums, which would refuse the swapped file first
    (tag_b / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="embed.weight"):
        zero_to_fp32(tmp_path / "b", tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()

    with pytest.raises(CheckpointError, match="no ZeRO partition files"):
        save_checkpoint(tmp_path / "c", "t", {layout.model_file(): {"model": params}})
        zero_to_fp32(tmp_path / "c", tmp_path / "x.safetensors")


PEAK_SCRIPT = textwrap.dedent(
    """
    import resource, sys, torch
    from zerotron.checkpoint.zero_to_fp32 import zero_to_fp32
    torch.ones(1)  # torch fully imported before the baseline
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    zero_to_fp32(sys.argv[1], sys.argv[2])
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print((after - before) * 1024)
    """
)


def test_peak_memory_stays_below_the_output_size(tmp_path):
    """A 128 MB fp32 model over 4 ranks (files with Adam-like moments: 384 MB): the process
    holds about one rank's partitions at a time, not the model, let alone the moments."""
    g = torch.Generator().manual_seed(0)
    params = {f"w{i}": torch.randn(2048, 2048, generator=g) for i in range(8)}  # 8 x 16 MB
    out_bytes = sum(p.numel() * 4 for p in params.values())
    files = {}
    for r, st in enumerate(zero_states(params, dp=4, sub_group_size=3_000_000)):
        st["optimizer"]["state"] = {
            i: {"exp_avg": f.clone(), "exp_avg_sq": f.clone()}
            for i, f in enumerate(st["fp32_partitions"])
        }
        files[layout.zero_file(r)] = st
    save_checkpoint(tmp_path / "big", "t", files, {})
    del files, st
    out = tmp_path / "big.safetensors"
    res = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(tmp_path / "big"), str(out)],
        capture_output=True,
        text=True,
        check=True,
    )
    grown = int(res.stdout.split()[-1])
    assert grown < 0.5 * out_bytes, f"peak RSS grew {grown / 2**20:.0f} MB for a 128 MB output"
    with safe_open(str(out), "pt") as f:
        for name in ("w0", "w7"):
            assert torch.equal(f.get_tensor(name), params[name])

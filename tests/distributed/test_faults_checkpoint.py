"""A checkpoint save that fails on one rank (issue 19, F2): every rank stops with a clean error
at once (no rank left waiting in a barrier), no temp files remain, the previous checkpoint and
the trackers are kept. Two gloo ranks, each writing its own file, through save_checkpoint with
the Engine's any-rank agreement."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import torch

from zerotron.checkpoint import save_load
from zerotron.distributed import comm
from zerotron.errors import ZerotronError

from .spawn import run_ranks


def _any_rank(flag: bool) -> bool:
    t = torch.tensor([int(flag)], dtype=torch.int32)
    return bool(comm.all_reduce(t, comm.world_group(), op="max").item())


def _save(rank: int, root: str, tag: str) -> str:
    files = {f"rank{rank}.pt": {"w": torch.full((4,), float(rank))}}
    try:
        save_load.save_checkpoint(
            root, tag, files, is_writer=rank == 0, barrier=comm.barrier, any_rank=_any_rank
        )
    except ZerotronError as e:
        return f"{type(e).__name__}: {e.what}"
    return "ok"


def _rank(rank: int, root: str) -> dict:
    out = {"first": _save(rank, root, "iter_0000001")}
    real_write = save_load._write_file

    def failing_write(path, obj):  # rank 1's disk is full when it writes its file
        if rank == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real_write(path, obj)

    save_load._write_file = failing_write
    out["write"] = _save(rank, root, "iter_0000002")
    save_load._write_file = real_write

    real_space = save_load._space_problem

    def no_room(save_dir, files):  # rank 1 finds too little free space up front
        if rank == 1:
            return save_load.DiskFullError("not enough space (test)", where=str(save_dir))
        return real_space(save_dir, files)

    save_load._space_problem = no_room
    out["space"] = _save(rank, root, "iter_0000003")
    save_load._space_problem = real_space
    comm.barrier()
    return out


def test_a_save_failing_on_one_rank_stops_every_rank_cleanly(tmp_path):
    outs = run_ranks(_rank, 2, str(tmp_path), timeout=60)
    assert [o["first"] for o in outs] == ["ok", "ok"]
    assert outs[1]["write"].startswith("DiskFullError: no space left on device")
    assert outs[0]["write"] == (
        "CheckpointError: another rank could not write its checkpoint files; this rank stopped "
        "with it"
    )
    assert outs[1]["space"] == "DiskFullError: not enough space (test)"
    assert outs[0]["space"].startswith("CheckpointError: another rank had no room")
    assert sorted(os.listdir(tmp_path)) == [
        "iter_0000001",
        "latest",
        "latest_checkpointed_iteration.txt",
    ]
    assert (Path(tmp_path) / "latest").read_text() == "iter_0000001"

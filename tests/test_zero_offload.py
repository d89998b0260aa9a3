"""ZeRO offload (zerotron/zero/offload/, zerotron/zero/options.py): options, swap files, and an
optimizer that steps with its masters and states on the host or on disk bitwise like torch does
in place."""

from __future__ import annotations

import errno
import functools
import gc
import os
import threading
import time

import psutil
import pytest
import torch

from zerotron.errors import CheckpointError, ConfigError, DiskFullError
from zerotron.zero.offload import NVMeSwapper, OffloadedOptimizer, ParamOffloadStore
from zerotron.zero.options import OffloadOptions

# ---------------------------------------------------------------------------------- options


def test_options_validate_names_the_key_path(tmp_path):
    where = "zero_optimization.offload_optimizer"
    OffloadOptions().validate(where)
    OffloadOptions(device="cpu", pin_memory=True).validate(where)
    OffloadOptions(device="nvme", nvme_path=str(tmp_path)).validate(where)
    a_file = tmp_path / "f"
    a_file.write_text("x")
    bad = [
        (OffloadOptions(device="gpu"), "device"),
        (OffloadOptions(device="nvme"), "nvme_path"),
        (OffloadOptions(device="nvme", nvme_path=str(tmp_path / "missing")), "nvme_path"),
        (OffloadOptions(device="nvme", nvme_path=str(a_file)), "nvme_path"),
        (OffloadOptions(device="cpu", buffer_count=0), "buffer_count"),
        (OffloadOptions(device="cpu", buffer_count=2.5), "buffer_count"),
    ]
    for opts, key in bad:
        with pytest.raises(ConfigError) as e:
            opts.validate(where)
        assert e.value.where == f"{where}.{key}", (opts, str(e.value))
    with pytest.raises(ConfigError, match="does not exist") as e:
        OffloadOptions(device="nvme", nvme_path=str(tmp_path / "missing")).validate(where)
    assert "mkdir -p" in e.value.fix


def test_options_unwritable_nvme_path(tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr("tempfile.mkstemp", refuse)
    with pytest.raises(ConfigError, match="not writable") as e:
        OffloadOptions(device="nvme", nvme_path=str(tmp_path)).validate("x.offload_param")
    assert e.value.where == "x.offload_param.nvme_path"


def test_options_from_deepspeed_section(tmp_path):
    where = "zero_optimization.offload_optimizer"
    section = {"device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True,
               "buffer_count": 3, "fast_init": False, "pipeline_read": True}  # fmt: skip
    assert OffloadOptions.from_dict(section, where) == OffloadOptions(
        device="nvme", nvme_path=str(tmp_path), pin_memory=True, buffer_count=3
    )
    assert OffloadOptions.from_dict(None, where) == OffloadOptions()
    with pytest.raises(ConfigError, match="unknown key") as e:
        OffloadOptions.from_dict({"device": "cpu", "devise": "cpu"}, where)
    assert e.value.where == where
    with pytest.raises(ConfigError) as e:
        OffloadOptions.from_dict({"device": "cpu", "ratio": 0.5}, where)
    assert e.value.where == f"{where}.ratio"


# ---------------------------------------------------------------------------------- swapper


def test_swapper_round_trip_raw_bytes(tmp_path):
    sw = NVMeSwapper(tmp_path, "rank0")
    a = torch.randn(1000)
    b = [torch.randn(3, 5).bfloat16(), torch.arange(7, dtype=torch.float16), torch.randn(0)]
    sw.swap_out("a", a)
    sw.swap_out("b", b)
    files = sorted(os.listdir(tmp_path / "zerotron_swap" / "rank0"))
    assert files == ["a.bin", "b.bin"]  # no temporaries, no sidecars, no pickles
    raw = (tmp_path / "zerotron_swap" / "rank0" / "a.bin").read_bytes()
    assert raw == a.numpy().tobytes()
    assert sw.bytes_on_disk() == 4000 + 30 + 14
    assert torch.equal(sw.swap_in("a"), a)
    back = sw.swap_in("b")
    assert isinstance(back, list) and all(torch.equal(x, y) for x, y in zip(back, b))
    assert [x.dtype for x in back] == [torch.bfloat16, torch.float16, torch.float32]
    out = torch.empty(1000)
    assert sw.swap_in("a", out) is out and torch.equal(out, a)
    with pytest.raises(ValueError, match="buffer"):
        sw.swap_in("a", torch.empty(999))
    sw.swap_out("a", a * 2)  # replace
    assert torch.equal(sw.swap_in("a"), a * 2)
    sw.release("a")
    assert "a" not in sw and not (tmp_path / "zerotron_swap" / "rank0" / "a.bin").exists()
    sw.cleanup()
    assert os.listdir(tmp_path) == []


def test_swapper_any_key_gets_its_own_file(tmp_path):
    sw = NVMeSwapper(tmp_path, "rank0")
    keys = ["_orig_mod.h.0.weight", "a/b", "a_b", "../up", "", "x" * 300]
    for n, key in enumerate(keys):
        sw.swap_out(key, torch.full((3,), float(n)))
    assert len({sw.path(k) for k in keys}) == len(keys)
    assert all(sw.path(k).parent == sw.dir for k in keys)
    assert sw.path("_orig_mod.h.0.weight").name == "_orig_mod.h.0.weight.bin"
    for n, key in enumerate(keys):
        assert torch.equal(sw.swap_in(key), torch.full((3,), float(n)))
    sw.release("a/b")
    assert sorted(sw.keys()) == sorted(k for k in keys if k != "a/b")
    assert len(os.listdir(sw.dir)) == len(keys) - 1
    sw.cleanup()


def test_swapper_truncated_or_missing_file_is_a_clear_error(tmp_path):
    sw = NVMeSwapper(tmp_path, "rank1", where="zero_optimization.offload_optimizer.nvme_path")
    sw.swap_out("k", torch.randn(100))
    path = sw.path("k")
    with open(path, "r+b") as f:
        f.truncate(396)
    with pytest.raises(CheckpointError, match="holds 396 bytes, expected 400") as e:
        sw.swap_in("k")
    assert str(path) in str(e.value)
    os.unlink(path)
    with pytest.raises(CheckpointError, match="missing"):
        sw.swap_in("k")
    sw.cleanup()


def test_swapper_directory_is_private(tmp_path):
    stale = tmp_path / "zerotron_swap" / "rank0"
    stale.mkdir(parents=True)
    (stale / "old.bin").write_bytes(b"junk")
    sw = NVMeSwapper(tmp_path, "rank0")
    assert os.listdir(sw.dir) == []  # a dead run's leftovers are cleared
    with pytest.raises(ConfigError, match="in use by another process"):
        NVMeSwapper(tmp_path, "rank0")
    sw.cleanup()
    NVMeSwapper(tmp_path, "rank0").cleanup()  # free again once the first is gone


def test_swapper_files_survive_a_forked_child(tmp_path):
    sw = NVMeSwapper(tmp_path, "rank0")
    sw.swap_out("k", torch.ones(4))
    pid = os.fork()
    if pid == 0:  # e.g. a data-loader worker: its exit must not delete the parent's files
        sw.cleanup()
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert torch.equal(sw.swap_in("k"), torch.ones(4))
    sw.cleanup()
    assert not sw.dir.exists()


def _fake_writes(monkeypatch, root, mode):
    """Make os.write on files under ``root`` behave like a disk that fills up."""
    real = os.write
    calls = {"n": 0}

    def fake(fd, data):
        if not os.readlink(f"/proc/self/fd/{fd}").startswith(str(root)):
            return real(fd, data)
        calls["n"] += 1
        if mode == "enospc_after_short":  # the first write stores part, the next one fails
            if calls["n"] == 1:
                return real(fd, bytes(data)[: len(data) // 3])
            raise OSError(errno.ENOSPC, "No space left on device")
        if mode == "zero":
            return 0
        if mode == "lie":  # claims everything, stores half
            real(fd, bytes(data)[: len(data) // 2])
            return len(data)
        raise AssertionError(mode)

    monkeypatch.setattr(os, "write", fake)


@pytest.mark.parametrize("mode", ["enospc_after_short", "zero", "lie"])
def test_swapper_disk_full_keeps_previous_contents(tmp_path, monkeypatch, mode):
    where = "zero_optimization.offload_optimizer.nvme_path"
    sw = NVMeSwapper(tmp_path, "rank0", where=where)
    old = torch.randn(3000)
    sw.swap_out("k", old)
    with monkeypatch.context() as m:
        _fake_writes(m, tmp_path, mode)
        with pytest.raises(DiskFullError) as e:
            sw.swap_out("k", torch.randn(3000))
    msg = str(e.value)
    assert str(sw.path("k")) in msg and "12,000 bytes" in msg and "bytes free" in msg
    assert e.value.where == where and "nvme_path at a larger disk" in e.value.fix
    assert torch.equal(sw.swap_in("k"), old)
    assert os.listdir(sw.dir) == ["k.bin"]  # the temporary is gone
    sw.cleanup()


# -------------------------------------------------------------------------------- optimizer

# Two groups of sub-groups, sizes that do not divide evenly (a flat 10_000-element partition in
# sub-groups of 3_000, and a second group), as the ZeRO optimizer builds them.
SIZES = [[3000, 3000, 3000, 1000], [1, 517]]
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}, {"weight_decay": 0.0}),
    "adam": (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.05, "amsgrad": True}, {}),
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}, {"lr": 0.05}),
    "sgd-plain": (torch.optim.SGD, {"lr": 0.1}, {}),  # no state at all
}
IMPLS = {"for": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def _make(name, impl="foreach", seed=0):
    cls, kw, group1 = OPTIMIZERS[name]
    g = torch.Generator().manual_seed(seed)
    groups = [[torch.randn(n, generator=g) for n in sizes] for sizes in SIZES]
    return cls([{"params": groups[0]}, {"params": groups[1], **group1}], **kw, **IMPLS[impl])


def _grads(step):
    g = torch.Generator().manual_seed(1000 + step)
    grads = [torch.randn(n, generator=g) for sizes in SIZES for n in sizes]
    if step == 1:
        grads[2] = None  # a sub-group without a gradient is not stepped, as in torch
    return grads


def _reference(name, impl, steps, lrs=None):
    opt = _make(name, impl)
    params = [p for g in opt.param_groups for p in g["params"]]
    for s in range(steps):
        if lrs:
            opt.param_groups[0]["lr"] = lrs[s]
        for p, g in zip(params, _grads(s)):
            p.grad = g
        opt.step()
    return opt


def _record(seen, i, master):
    seen.append((i, master.clone()))


def _assert_same(off: OffloadedOptimizer, ref: torch.optim.Optimizer):
    sd, want = off.state_dict(), ref.state_dict()
    masters = [p for g in ref.param_groups for p in g["params"]]
    assert len(sd["fp32_partitions"]) == len(masters)
    for a, b in zip(sd["fp32_partitions"], masters):
        assert a.dtype == b.dtype and torch.equal(a, b)
    got = sd["optimizer"]
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for i, s in want["state"].items():
        assert list(got["state"][i]) == list(s)  # same keys in torch's order
        for k, v in s.items():
            w = got["state"][i][k]
            if torch.is_tensor(v):
                assert w.dtype == v.dtype and torch.equal(w, v), (i, k)
            else:
                assert w == v, (i, k)


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_offloaded_step_is_bitwise_torch(tmp_path, name, impl):
    steps, lrs = 3, [1e-2, 5e-3, 2e-3]
    ref = _reference(name, impl, steps, lrs)
    runs = [("none", 4), ("cpu", 4), ("nvme", 1), ("nvme", 3)]
    for device, buffers in runs:
        opts = OffloadOptions(device, str(tmp_path), buffer_count=buffers)
        off = OffloadedOptimizer(_make(name, impl), opts, rank_name=f"r{device}{buffers}")
        updated: list[tuple[int, torch.Tensor]] = []
        for s in range(steps):
            off.optimizer.param_groups[0]["lr"] = lrs[s]  # what an LR scheduler does
            off.step(_grads(s), on_updated=functools.partial(_record, updated))
        _assert_same(off, ref)
        # on_updated saw each stepped sub-group right after its update, in index order
        final = {i: m for i, m in updated[-len(off) :]}
        assert sorted(final) == list(range(len(off)))
        for i, m in final.items():
            assert torch.equal(m, off.state_dict()["fp32_partitions"][i])
        assert [i for i, _ in updated[len(off) : 2 * len(off) - 1]] == [0, 1, 3, 4, 5]
        views = list(off.masters())
        assert [v.index for v in views] == list(range(len(off)))
        assert all(v.resident == (device != "nvme") for v in views)
        off.close()


def test_wrapping_an_optimizer_that_has_state(tmp_path):
    ref = _reference("adam", "foreach", 3)
    for device in ("cpu", "nvme"):
        opt = _make("adam")
        for p, grad in zip([q for grp in opt.param_groups for q in grp["params"]], _grads(0)):
            p.grad = grad
        opt.step()  # state exists before offload takes over
        opt.zero_grad()
        opts = OffloadOptions(device, str(tmp_path), buffer_count=2)
        off = OffloadedOptimizer(opt, opts, rank_name=device)
        if device == "nvme":
            assert len(opt.state) == 0 and off.resident_state_bytes() == 6 * 4  # "step"s
        for s in (1, 2):
            off.step(_grads(s))
        _assert_same(off, ref)
        off.close()


def test_masters_stream_and_grads_of_other_dtypes(tmp_path):
    ref = _make("adamw")
    params = [p for g in ref.param_groups for p in g["params"]]
    grads16 = [None if g is None else g.bfloat16() for g in _grads(0)]
    for p, g in zip(params, grads16):
        p.grad = g.float()
    ref.step()
    for device in ("cpu", "nvme"):
        opts = OffloadOptions(device, str(tmp_path), buffer_count=2)
        off = OffloadedOptimizer(_make("adamw"), opts, rank_name=device)
        off.step(dict(enumerate(grads16)))  # a dict works as well as a list
        seen = [(v.index, v.tensor.clone()) for v in off.masters()]
        assert [i for i, _ in seen] == list(range(len(params)))
        for (_, m), p in zip(seen, params):
            assert torch.equal(m, p)
        if device == "nvme":
            assert all(p.numel() == 0 for g in off.optimizer.param_groups for p in g["params"])
            assert off.shape(0) == torch.Size([3000])
        off.close()


def test_state_dict_round_trip_across_devices(tmp_path):
    """none -> nvme -> cpu through torch.save / torch.load(weights_only=True) equals 6 steps
    without offload, and the files written from each device hold the same values."""
    ref = _reference("adamw", "foreach", 6)
    off = OffloadedOptimizer(_make("adamw"), OffloadOptions("none"), rank_name="a")
    for s in range(2):
        off.step(_grads(s))
    torch.save(off.state_dict(), tmp_path / "a.pt")
    opts = OffloadOptions("nvme", str(tmp_path), buffer_count=2)
    off = OffloadedOptimizer(_make("adamw", seed=7), opts, rank_name="b")  # other masters
    off.load_state_dict(torch.load(tmp_path / "a.pt", weights_only=True))
    same = torch.load(tmp_path / "a.pt", weights_only=True)
    again = off.state_dict()
    assert all(torch.equal(x, y) for x, y in zip(again["fp32_partitions"], same["fp32_partitions"]))
    assert again["optimizer"]["param_groups"] == same["optimizer"]["param_groups"]
    for s in range(2, 4):
        off.step(_grads(s))
    torch.save(off.state_dict(), tmp_path / "b.pt")
    off.close()
    off = OffloadedOptimizer(_make("adamw", seed=8), OffloadOptions("cpu"), rank_name="c")
    loaded = torch.load(tmp_path / "b.pt", weights_only=True)
    off.load_state_dict(loaded)
    for s in range(4, 6):
        off.step(_grads(s))
    _assert_same(off, ref)
    # load copies: stepping did not write into the dict it was loaded from
    assert torch.equal(
        loaded["fp32_partitions"][0], torch.load(tmp_path / "b.pt")["fp32_partitions"][0]
    )


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_load_masters_keeps_the_state(tmp_path, device):
    opts = OffloadOptions(device, str(tmp_path), buffer_count=2)
    off = OffloadedOptimizer(_make("adamw"), opts, rank_name="m")
    fresh = off.state_dict()  # no optimizer state yet
    fresh = {
        "optimizer": fresh["optimizer"],
        "fp32_partitions": [m.clone() for m in fresh["fp32_partitions"]],
    }
    off.step(_grads(0))
    before = off.state_dict()
    before = {
        "optimizer": before["optimizer"],
        "fp32_partitions": [m.clone() for m in before["fp32_partitions"]],
    }
    new = [
        torch.full(m.shape, float(i)).bfloat16() for i, m in enumerate(before["fp32_partitions"])
    ]
    off.load_masters(new)
    after = off.state_dict()
    for m, n in zip(after["fp32_partitions"], new):
        assert m.dtype == torch.float32 and torch.equal(m, n.float())
    for i, st in before["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(after["optimizer"]["state"][i][k], v)
    with pytest.raises(CheckpointError):
        off.load_masters(new[:-1])
    off.load_state_dict(fresh)  # back to no state: nothing stale stays behind
    assert off.state_dict()["optimizer"]["state"] == {}
    if device == "nvme":
        assert off.bytes_on_disk() == sum(m.numel() * 4 for m in new)
    off.close()


def test_load_state_dict_checks_the_layout(tmp_path):
    off = OffloadedOptimizer(_make("sgd"), OffloadOptions("cpu"), rank_name="x")
    sd = off.state_dict()
    with pytest.raises(CheckpointError, match="6 sub-groups"):
        off.load_state_dict({**sd, "fp32_partitions": sd["fp32_partitions"][:-1]})
    bad = [torch.zeros(5)] + sd["fp32_partitions"][1:]
    with pytest.raises(CheckpointError, match="partition 0 has shape"):
        off.load_state_dict({**sd, "fp32_partitions": bad})


def test_step_on_a_full_disk_raises_disk_full(tmp_path, monkeypatch):
    opts = OffloadOptions("nvme", str(tmp_path), buffer_count=2)
    off = OffloadedOptimizer(_make("adamw"), opts, rank_name="r0")
    off.step(_grads(0))
    before = off.state_dict()
    with monkeypatch.context() as m:
        _fake_writes(m, tmp_path, "zero")
        with pytest.raises(DiskFullError, match="disk full writing swap file") as e:
            off.step(_grads(1))
    assert "offload_optimizer.nvme_path" in e.value.where
    assert sorted(os.listdir(off._swapper.dir)) == sorted(
        [f"master{i}.bin" for i in range(6)] + [f"state{i}.bin" for i in range(6)]
    )  # no temporaries; each file holds its last complete write
    after = off.state_dict()
    for x, y in zip(after["fp32_partitions"], before["fp32_partitions"]):
        assert torch.equal(x, y)  # every write of the failed step was refused
    off.close()


# ------------------------------------------------------------------------------------ memory

# AdamW: master + 2 moments, 3 x 700 kB per sub-group, 67 MB in all. Small sub-groups make the
# allocator's share of the RSS growth small (torch's temporaries, the first step's new state).
N_SUB, SUB = 32, 175_000


def test_nvme_resident_memory_stays_within_buffer_count(tmp_path):
    warm = OffloadedOptimizer(_make("adamw"), OffloadOptions("nvme", str(tmp_path)), rank_name="w")
    warm.step(_grads(0))  # torch's lazy imports and first-call caches are not state
    warm.close()
    masters = [torch.randn(SUB) for _ in range(N_SUB)]
    opt = torch.optim.AdamW(masters, lr=1e-3, weight_decay=0.01, foreach=True)
    del masters
    opts = OffloadOptions("nvme", str(tmp_path), buffer_count=2)
    off = OffloadedOptimizer(opt, opts, rank_name="rank0")
    grads = [torch.randn(SUB) for _ in range(N_SUB)]
    per_sub_group = 3 * SUB * 4
    proc = psutil.Process()
    gc.collect()
    peak = {"resident": 0, "rss": 0}
    stop = threading.Event()

    def sample():  # RSS from another thread, so the I/O thread's moments count too
        while not stop.is_set():
            peak["rss"] = max(peak["rss"], proc.memory_info().rss)
            time.sleep(0.001)

    def on_updated(i, master):
        peak["resident"] = max(peak["resident"], off.resident_state_bytes())

    rss0 = proc.memory_info().rss
    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        for _ in range(3):
            off.step(grads, on_updated=on_updated)
    finally:
        stop.set()
        sampler.join()
    total = off.total_state_bytes()
    assert total == N_SUB * per_sub_group + N_SUB * 4  # + Adam's scalar "step"s
    assert off.bytes_on_disk() == N_SUB * per_sub_group
    # two slots (each one sub-group's master + moments, 64-byte aligned) and the step scalars
    assert peak["resident"] <= 2 * (per_sub_group + 3 * 64) + N_SUB * 4
    assert off.resident_state_bytes() <= 2 * (per_sub_group + 3 * 64) + N_SUB * 4
    growth = peak["rss"] - rss0
    print(f"RSS growth {growth / 2**20:.1f} MiB, state {total / 2**20:.1f} MiB")
    assert growth < total / 3, (growth, total)
    off.close()


# -------------------------------------------------------------------------------- parameters


@pytest.mark.parametrize("device", ["none", "cpu", "nvme"])
def test_param_store(tmp_path, device):
    store = ParamOffloadStore(OffloadOptions(device, str(tmp_path)), "rank0")
    shards = {"h.0.attn.qkv": torch.randn(96).bfloat16(), 3: torch.randn(7, 2).half()}
    for k, t in shards.items():
        store.put(k, t)
    for k, t in shards.items():
        assert k in store
        got = store.get(k)
        assert got.dtype == t.dtype and torch.equal(got, t)
        out = torch.empty_like(t)
        assert store.get(k, out=out) is out and torch.equal(out, t)
    store.put(3, shards[3] + 1)
    assert torch.equal(store.get(3), shards[3] + 1)
    if device == "nvme":
        assert store.resident_bytes() == 0 and store.bytes_on_disk() == 96 * 2 + 14 * 2
    elif device == "cpu":
        assert store.resident_bytes() == 96 * 2 + 14 * 2 and store.bytes_on_disk() == 0
    store.release(3)
    assert 3 not in store
    store.close()
    assert not (tmp_path / "zerotron_swap" / "rank0.params").exists()

"""ZeRO-Offload and ZeRO-Infinity: optimizer states and parameters on the host or on NVMe.

ZeRO partitions the fp32 master weights and optimizer states over data-parallel ranks; this
module decides *where* a rank's partition lives while it is not being stepped. The math does
not change: stepping through :class:`OffloadedOptimizer` gives bitwise the same masters and
states as stepping the same torch optimizer over the same tensors without offload.

Pieces (the ZeRO optimizer in :mod:`zerotron.zero.optimizer` composes them):

- :class:`OffloadOptions` — DeepSpeed's ``offload_optimizer`` / ``offload_param`` section
  (``device`` none|cpu|nvme, ``nvme_path``, ``pin_memory``, ``buffer_count``), validated with
  errors that name the key path.
- :class:`NVMeSwapper` — named tensors in raw files under ``<root>/zerotron_swap/<name>/``,
  one file per key. Writes go to a temporary file that is renamed over the old one only when
  every byte is in, so a full disk (:class:`~zerotron.errors.DiskFullError`) never corrupts
  what was there. Reads check the exact size. No pickle anywhere: dtype and shape stay in
  memory.
- :class:`OffloadedOptimizer` — steps a torch optimizer (Adam, AdamW, SGD: elementwise
  optimizers that keep per-parameter state) whose parameters are the rank's fp32 master
  "sub-groups" (DeepSpeed's ``sub_group_size`` pieces). ``cpu`` keeps masters and states in host
  memory and steps there; ``nvme`` keeps them in files and streams them through a pool of
  ``buffer_count`` slots, one sub-group per slot, reading the next sub-groups and writing the
  previous ones on a background thread while the current one steps.
- :class:`ParamStore` — ZeRO-3's ``offload_param``: 16-bit parameter shards kept on the host or
  in files, ``put`` / ``get`` by key.

Offload is a memory trade, not an approximation. What each device keeps resident:

============  ======================================================================
``none``      masters and states where the caller made them (the accelerator)
``cpu``       masters and states in host memory (masters pinned with ``pin_memory``)
``nvme``      ``buffer_count`` sub-groups' masters and states, plus each sub-group's
              scalar state (Adam's ``step``), a few bytes
============  ======================================================================

``buffer_count`` counts sub-groups resident at once (DeepSpeed counts tensor buffers; its
default of 4 holds one Adam sub-group: master, gradient and two moments). Swap files are
scratch: they are deleted by :meth:`OffloadedOptimizer.close` (or at exit) and are not
fsynced; checkpoints (:meth:`OffloadedOptimizer.state_dict`) are the durable copy.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import shutil
import tempfile
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

import torch

from zerotron.errors import CheckpointError, ConfigError, DiskFullError
from zerotron.fileio import temp_path

Device = Literal["none", "cpu", "nvme"]

_ALIGN = 64  # bytes: every tensor carved from a pool slot starts on a cache line
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_SAME_LAYOUT = "load with the data-parallel size and sub_group_size the checkpoint was saved with"

# DeepSpeed keys of the offload sections that only tune its async-I/O library: accepted, unused.
_DS_TUNING_KEYS = frozenset(
    {"buffer_size", "max_in_cpu", "pipeline", "pipeline_read", "pipeline_write", "fast_init"}
)


# --------------------------------------------------------------------------------------------
# Options


@dataclass
class OffloadOptions:
    """One offload section of a DeepSpeed config (``zero_optimization.offload_optimizer`` or
    ``zero_optimization.offload_param``).

    Attributes:
        device: ``"none"`` (no offload), ``"cpu"`` (host memory) or ``"nvme"`` (files).
        nvme_path: directory for the swap files (device ``"nvme"`` only); must exist and be
            writable. Each process uses ``<nvme_path>/zerotron_swap/<rank name>.<kind>/``.
        pin_memory: page-lock the host buffers that cross to and from an accelerator (no
            effect without CUDA).
        buffer_count: sub-groups (optimizer) or shards (parameters) resident at once with
            ``"nvme"``; at least 1, 2 or more lets reads and writes overlap the step.
    """

    device: Device = "none"
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = 4

    @property
    def enabled(self) -> bool:
        return self.device != "none"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None, where: str) -> OffloadOptions:
        """Options from a DeepSpeed JSON section, validated; ``where`` is its key path."""
        if d is None:
            return cls()
        known = {"device", "nvme_path", "pin_memory", "buffer_count", "ratio"}
        unknown = sorted(set(d) - known - _DS_TUNING_KEYS)
        if unknown:
            raise ConfigError(
                f"unknown key(s) {unknown}",
                where=where,
                fix=f"use {sorted(known)} (DeepSpeed's {sorted(_DS_TUNING_KEYS)} are ignored)",
            )
        ratio = d.get("ratio", 1.0)
        if ratio != 1.0:
            raise ConfigError(
                f"partial offload (ratio {ratio}) is not supported",
                where=f"{where}.ratio",
                fix="remove ratio (everything is offloaded)",
            )
        kw = {k: d[k] for k in known - {"ratio"} if k in d}
        if kw.get("nvme_path") is not None:
            kw["nvme_path"] = str(kw["nvme_path"])
        opts = cls(**kw)
        opts.validate(where)
        return opts

    def validate(self, where: str) -> None:
        """Raise :class:`ConfigError` naming ``<where>.<key>`` if a value cannot work."""
        if self.device not in ("none", "cpu", "nvme"):
            raise ConfigError(
                f"device must be none, cpu or nvme, got {self.device!r}",
                where=f"{where}.device",
                fix='set "device": "cpu" (host memory) or "nvme" (files under nvme_path)',
            )
        if isinstance(self.buffer_count, bool) or not isinstance(self.buffer_count, int):
            raise ConfigError(
                f"buffer_count must be an integer, got {self.buffer_count!r}",
                where=f"{where}.buffer_count",
            )
        if self.buffer_count < 1:
            raise ConfigError(
                f"buffer_count must be at least 1, got {self.buffer_count}",
                where=f"{where}.buffer_count",
                fix="use 2 or more so reads and writes overlap the step (default 4)",
            )
        if not isinstance(self.pin_memory, bool):
            raise ConfigError(
                f"pin_memory must be true or false, got {self.pin_memory!r}",
                where=f"{where}.pin_memory",
            )
        if self.device == "nvme":
            _check_nvme_path(self.nvme_path, f"{where}.nvme_path")


def _check_nvme_path(path: str | None, where: str) -> None:
    if not path:
        raise ConfigError(
            'device "nvme" needs nvme_path',
            where=where,
            fix='set "nvme_path" to a directory on a fast local disk, e.g. "/local_nvme"',
        )
    p = Path(path)
    if not p.exists():
        raise ConfigError(
            f"nvme_path {str(p)!r} does not exist", where=where, fix=f"create it: mkdir -p {p}"
        )
    if not p.is_dir():
        raise ConfigError(f"nvme_path {str(p)!r} is not a directory", where=where)
    try:  # os.access says yes to root even on a read-only mount: try for real
        fd, probe = tempfile.mkstemp(dir=p, prefix=".zerotron-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(
            f"nvme_path {str(p)!r} is not writable ({e.strerror or e})",
            where=where,
            fix="point nvme_path at a directory this user can write",
        ) from e


# --------------------------------------------------------------------------------------------
# Raw tensor files


class _Spec(NamedTuple):
    dtype: torch.dtype
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _bytes_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (works for bf16, which numpy lacks)."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def _remove_dir(path: Path, lock_fd: int, owner: int) -> None:
    if os.getpid() != owner:  # a forked child exiting must not delete its parent's files
        return
    shutil.rmtree(path, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.unlink(f"{path}.lock")
    with contextlib.suppress(OSError):
        path.parent.rmdir()  # zerotron_swap/, if no other process uses it
    with contextlib.suppress(OSError):
        os.close(lock_fd)  # releases the flock


def _open_lock(path: Path) -> int:
    """Create ``zerotron_swap/`` and open ``<path>.lock`` in it.

    Another rank that finishes removes ``zerotron_swap/`` once it is empty (``_remove_dir``); it
    can do so between our ``mkdir`` and ``open``, so retry. Once our lock file is in it, the
    directory is not empty and stays.
    """
    for attempt in range(100):
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            if attempt == 99:
                raise
    raise AssertionError("unreachable")


class NVMeSwapper:
    """Named tensors (or lists of tensors) as raw files under ``<root>/zerotron_swap/<name>/``.

    One file per key (``<key>.bin``), holding the tensors' bytes back to back; dtypes and
    shapes stay in this object, so a file is never interpreted without them and nothing is
    unpickled. The directory belongs to this object: a stale one from an earlier run is
    emptied, a second live process asking for the same one gets a :class:`ConfigError`, and
    :meth:`cleanup` (or garbage collection, or interpreter exit) removes it.

    Args:
        root: the ``nvme_path`` directory.
        name: this process's subdirectory, e.g. ``"rank3.optimizer"``.
        where: the config key to name in a disk-full error.
    """

    def __init__(self, root: str | os.PathLike, name: str, *, where: str = "nvme_path"):
        if not _NAME.fullmatch(name):
            raise ValueError(f"swap name {name!r}: use letters, digits, '.', '_' or '-'")
        self.root = Path(root)
        self.where = where
        self.dir = self.root / "zerotron_swap" / name
        lock_fd = _open_lock(self.dir)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock_fd)
            raise ConfigError(
                f"swap directory {self.dir} is in use by another process",
                where=where,
                fix="give every process its own rank name, or each job its own nvme_path",
            ) from None
        shutil.rmtree(self.dir, ignore_errors=True)  # ours, left by a process that died
        self.dir.mkdir()
        self._specs: dict[str, tuple[list[_Spec], bool]] = {}  # key -> (specs, is_list)
        self._paths: dict[str, Path] = {}
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _remove_dir, self.dir, lock_fd, os.getpid())

    def path(self, key: str) -> Path:
        """The file of ``key``: the key itself where it is a safe file name (parameter names
        are), else a sanitized form made unique."""
        with self._lock:
            path = self._paths.get(key)
            if path is None:
                stem = _UNSAFE.sub("_", key)[:120]
                stem = stem if _NAME.fullmatch(stem) else f"_{stem}"
                path = self.dir / f"{stem}.bin"
                taken = set(self._paths.values())
                n = 1
                while path in taken:
                    path, n = self.dir / f"{stem}~{n}.bin", n + 1
                self._paths[key] = path
            return path

    def __contains__(self, key: str) -> bool:
        return key in self._specs

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._specs)

    def specs(self, key: str) -> list[_Spec]:
        """dtype and shape of each tensor stored under ``key``."""
        return list(self._specs[key][0])

    def nbytes(self, key: str) -> int:
        return sum(s.nbytes for s in self._specs[key][0])

    def bytes_on_disk(self) -> int:
        """Bytes of all stored tensors (the files' sizes)."""
        with self._lock:
            return sum(s.nbytes for specs, _ in self._specs.values() for s in specs)

    def swap_out(self, key: str, tensors: torch.Tensor | Sequence[torch.Tensor]) -> None:
        """Write ``tensors`` as the new content of ``key``, replacing the old one atomically.

        Raises :class:`DiskFullError` (naming the file, the bytes and the free space) if the
        disk fills; the previous content of ``key`` is then still intact and readable.
        """
        is_list = not isinstance(tensors, torch.Tensor)
        ts = [t.detach() for t in (tensors if is_list else [tensors])]
        ts = [t.cpu().contiguous() if t.device.type != "cpu" else t.contiguous() for t in ts]
        specs = [_Spec(t.dtype, t.shape) for t in ts]
        path = self.path(key)
        total = sum(s.nbytes for s in specs)
        tmp = temp_path(path)
        written = 0
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                for t in ts:
                    view = _bytes_view(t)
                    off = 0
                    while off < len(view):
                        n = os.write(fd, view[off:])
                        if n <= 0:
                            raise OSError(errno.ENOSPC, "write made no progress")
                        off += n
                        written += n
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            if size != total:  # a write that claimed more than it stored
                written = size
                raise OSError(errno.ENOSPC, f"file holds {size} bytes after writing")
            os.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise self._disk_full(path, written, total) from e
            raise
        with self._lock:
            self._specs[key] = (specs, is_list)

    def _disk_full(self, path: Path, written: int, total: int) -> DiskFullError:
        try:
            free = f"{shutil.disk_usage(self.dir).free:,} bytes free"
        except OSError:
            free = "free space unknown"
        return DiskFullError(
            f"disk full writing swap file {path}: {written:,} of {total:,} bytes written, "
            f"{free} under {self.root}; the previous content of the file is intact",
            where=self.where,
            fix=f"free space under {self.root} or point {self.where} at a larger disk",
        )

    def swap_in(
        self, key: str, out: torch.Tensor | Sequence[torch.Tensor] | None = None
    ) -> torch.Tensor | list[torch.Tensor]:
        """Read ``key`` back: into ``out`` (contiguous CPU tensors of the stored dtypes and
        shapes, e.g. pool buffers) or into new tensors. Returns a list if a list was stored.

        A file whose size differs from what was written raises :class:`CheckpointError`.
        """
        specs, is_list = self._specs[key]
        if out is None:
            outs = [torch.empty(s.shape, dtype=s.dtype) for s in specs]
        else:
            outs = list(out) if not isinstance(out, torch.Tensor) else [out]
            for o, s in zip(outs, specs, strict=True):
                if o.dtype != s.dtype or o.shape != s.shape:
                    raise ValueError(
                        f"swap_in({key!r}): buffer {o.dtype} {tuple(o.shape)} for a stored "
                        f"{s.dtype} {tuple(s.shape)}"
                    )
                if o.device.type != "cpu" or not o.is_contiguous():
                    raise ValueError(f"swap_in({key!r}): buffers must be contiguous CPU tensors")
        path = self.path(key)
        total = sum(s.nbytes for s in specs)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise CheckpointError(
                f"swap file {path} is missing",
                where=self.where,
                fix="something removed the swap directory while training ran; "
                "restart from the last checkpoint, with a private nvme_path",
            ) from None
        try:
            size = os.fstat(fd).st_size
            if size != total:
                raise CheckpointError(
                    f"swap file {path} holds {size:,} bytes, expected {total:,}",
                    where=self.where,
                    fix="something truncated or rewrote the swap file; restart from the "
                    "last checkpoint, with a private nvme_path",
                )
            for o in outs:
                view = _bytes_view(o)
                off = 0
                while off < len(view):
                    n = os.readv(fd, [view[off:]])
                    if n <= 0:
                        raise CheckpointError(
                            f"swap file {path} ended early", where=self.where, fix=None
                        )
                    off += n
        finally:
            os.close(fd)
        return outs if is_list else outs[0]

    def release(self, key: str) -> None:
        """Forget ``key`` and delete its file."""
        with self._lock:
            self._specs.pop(key, None)
            path = self._paths.pop(key, None)
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def cleanup(self) -> None:
        """Delete the directory and everything in it."""
        with self._lock:
            self._specs.clear()
            self._paths.clear()
        self._finalizer()


# --------------------------------------------------------------------------------------------
# A pool of reusable host buffers


def _host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """``nbytes`` of host memory that goes back to the OS when the tensor dies: an anonymous
    mapping (or pinned memory from CUDA's host allocator). Pool slots are few and large; from
    malloc, glibc would keep the freed ones (its mmap threshold rises after the first free)
    and the process would grow by a few sub-groups each time a slot is resized."""
    if pin:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # "the given buffer is not writable": it is
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


class _Slot:
    """One reusable host buffer; tensors are carved from it at aligned offsets."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.buf: torch.Tensor | None = None

    def carve(self, specs: Sequence[_Spec]) -> list[torch.Tensor]:
        offsets, end = [], 0
        for s in specs:
            offsets.append(end)
            end += -(-s.nbytes // _ALIGN) * _ALIGN
        if self.buf is None or self.buf.numel() < end:
            self.buf = None  # drop the old one before allocating the bigger one
            self.buf = _host_buffer(end, self.pin)
        return [
            self.buf[o : o + s.nbytes].view(s.dtype).view(s.shape) for o, s in zip(offsets, specs)
        ]

    @property
    def nbytes(self) -> int:
        return 0 if self.buf is None else self.buf.numel()


# --------------------------------------------------------------------------------------------
# The optimizer


class MasterView(NamedTuple):
    """One sub-group's fp32 master as :meth:`OffloadedOptimizer.masters` yields it.

    ``resident`` is False when ``tensor`` is a pool buffer (``nvme``): valid until the
    iteration moves on, and writing into it changes nothing.
    """

    index: int
    tensor: torch.Tensor
    resident: bool


class _Record(NamedTuple):
    """What a swapped-out sub-group keeps in memory."""

    order: list[str]  # the state dict's keys in torch's order
    swapped: list[str]  # keys whose tensors live in the state file (shaped like the master)
    small: dict[str, Any]  # the rest (Adam's "step" tensor, flags), kept here


Grads = Sequence[torch.Tensor | None] | Mapping[int, torch.Tensor]


class OffloadedOptimizer:
    """Steps ``optimizer`` with its masters and states where ``options.device`` says.

    ``optimizer`` is a torch optimizer (Adam, AdamW, SGD) whose ``param_groups`` hold the
    rank's fp32 master sub-groups, built by the caller. Index ``i`` below is a master's
    position in ``[p for g in optimizer.param_groups for p in g["params"]]`` (the order of
    torch's state dict). The optimizer keeps its identity and hyper-parameters: LR schedulers
    keep writing ``param_groups[k]["lr"]``.

    - ``none``: nothing moves; :meth:`step` is ``optimizer.step()``.
    - ``cpu``: masters (and any existing state) move to host memory, pinned with
      ``pin_memory``; gradients are copied to the host and cast to the master dtype before
      the step; torch's CPU kernels step there.
    - ``nvme``: masters and states go to files; each master tensor object stays in
      ``param_groups`` as an empty placeholder (``numel() == 0``) and gets its storage back only
      while resident. :meth:`step` streams the sub-groups that have gradients through
      ``buffer_count`` slots: read master + state (background thread), step that one sub-group
      (the other groups' ``params`` lists are emptied for the call, so nothing else is
      touched), write back (background thread). Scalar state (Adam's per-tensor ``step``)
      stays in memory. Use :meth:`state_dict`, not ``optimizer.state_dict()``.

    Do not keep other references to the masters' storage: with ``nvme`` that is what would
    keep them in memory. Call :meth:`close` when done (deletes the swap files).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        options: OffloadOptions,
        *,
        rank_name: str | None = None,
        where: str = "zero_optimization.offload_optimizer",
    ):
        options.validate(where)
        rank_name = rank_name or _default_rank_name()
        self.optimizer = optimizer
        self.options = options
        self.device = options.device
        self._params: list[torch.Tensor] = [p for g in optimizer.param_groups for p in g["params"]]
        self._group_of = [k for k, g in enumerate(optimizer.param_groups) for _ in g["params"]]
        self._specs = [_Spec(p.dtype, p.shape) for p in self._params]
        self._pin = options.pin_memory and torch.cuda.is_available()
        self._swapper: NVMeSwapper | None = None
        self._records: dict[int, _Record] = {}
        self._inflight: dict[int, list[torch.Tensor]] = {}  # tensors handed to pending writes
        self._io: ThreadPoolExecutor | None = None
        self._slots: list[_Slot] = []
        self._placeholders: list[torch.Tensor] = []
        if self.device == "cpu":
            for p in self._params:
                p.data = self._to_host(p.data)
                for k, v in optimizer.state.get(p, {}).items():
                    if isinstance(v, torch.Tensor) and v.shape == p.shape:
                        optimizer.state[p][k] = v.to("cpu")
        elif self.device == "nvme":
            self._swapper = NVMeSwapper(
                options.nvme_path, f"{rank_name}.optimizer", where=f"{where}.nvme_path"
            )
            self._slots = [_Slot(self._pin) for _ in range(options.buffer_count)]
            self._placeholders = [torch.empty(0, dtype=p.dtype) for p in self._params]
            for i, p in enumerate(self._params):
                state = optimizer.state.pop(p, None)
                self._write(i, p.data.detach(), state)
                p.data = self._placeholders[i]

    # ---- public API ------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._params)

    def shape(self, index: int) -> torch.Size:
        """The shape of master ``index`` (with ``nvme`` the tensor itself is a placeholder)."""
        return self._specs[index].shape

    def step(
        self,
        grads: Grads | None = None,
        on_updated: Callable[[int, torch.Tensor], None] | None = None,
    ) -> None:
        """One optimizer step.

        Args:
            grads: master ``i``'s gradient as ``grads[i]`` (a list in index order, or a dict;
                None or missing = no gradient, and, as in torch, no update for that
                sub-group). Any device and float dtype: cast to the master's. With
                ``none``/``cpu`` it may be omitted to use the ``.grad`` already set on the
                masters. The ``.grad`` fields this method sets are cleared again.
            on_updated: called as ``on_updated(i, master)`` for each stepped sub-group right
                after its update while it is resident (with ``nvme`` the only moment it is),
                so the caller can copy it into its 16-bit parameters without reading it back.
        """
        if grads is None and self.device == "nvme":
            raise ValueError("OffloadedOptimizer.step: nvme offload needs grads passed in")
        if grads is not None:
            grads = self._grad_list(grads)
        if self.device == "nvme":
            self._step_nvme(grads, on_updated)
            return
        if grads is not None:
            for p, g in zip(self._params, grads):
                p.grad = None if g is None else self._grad_for(p, g)
        stepped = [i for i, p in enumerate(self._params) if p.grad is not None]
        try:
            self.optimizer.step()
        finally:
            if grads is not None:
                for p in self._params:
                    p.grad = None
        if on_updated is not None:
            for i in stepped:
                on_updated(i, self._params[i].data)

    def masters(self) -> Iterator[MasterView]:
        """Every master in index order. With ``nvme`` each is read into a pool slot (the next
        ones are read ahead) and is valid only until the iteration advances."""
        if self.device != "nvme":
            for i, p in enumerate(self._params):
                yield MasterView(i, p.data, True)
            return
        for i, tensors in self._stream(range(len(self._params)), with_state=False):
            yield MasterView(i, tensors[0], False)

    def state_dict(self) -> dict[str, Any]:
        """``{"optimizer": torch's Optimizer.state_dict() format, "fp32_partitions": [master
        per index]}``, all tensors on the CPU, the same whatever the device: a checkpoint
        written with one device loads with any other. Only tensors, numbers, strings, lists,
        tuples and dicts (``torch.load(weights_only=True)`` reads it). With ``none``/``cpu``
        the tensors are the live ones (save or clone them before the next step); with
        ``nvme`` they are fresh copies (the whole state in memory at once, as a save needs).
        """
        sd = self.optimizer.state_dict()
        if self.device != "nvme":
            sd["state"] = {i: {k: _cpu(v) for k, v in s.items()} for i, s in sd["state"].items()}
            return {"optimizer": sd, "fp32_partitions": [p.detach().cpu() for p in self._params]}
        state: dict[int, dict[str, Any]] = {}
        masters = []
        for i in range(len(self._params)):
            masters.append(self._swapper.swap_in(self._master_key(i)))
            rec = self._records.get(i)
            if rec is None:
                continue
            tensors = {k: v.clone() if torch.is_tensor(v) else v for k, v in rec.small.items()}
            if rec.swapped:
                tensors.update(zip(rec.swapped, self._swapper.swap_in(self._state_key(i))))
            state[i] = {k: tensors[k] for k in rec.order}
        sd["state"] = state
        return {"optimizer": sd, "fp32_partitions": masters}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        """Load what :meth:`state_dict` returned (from any device). Tensors are copied: the
        caller's dict is not aliased."""
        masters = sd["fp32_partitions"]
        self._check_masters(masters)
        osd = sd["optimizer"]
        state = {
            int(i): {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for i, s in osd["state"].items()
        }
        if self.device != "nvme":
            for p, m in zip(self._params, masters):
                p.data.copy_(m)
            self.optimizer.load_state_dict({**osd, "state": state})
            return
        self.optimizer.load_state_dict({**osd, "state": {}})  # hyper-parameters, group sizes
        self._records.clear()
        for i, p in enumerate(self._params):
            s = state.get(i)
            if s is not None:
                s = {k: _cast_like_torch(k, v, p.dtype) for k, v in s.items()}
            self._write(i, masters[i].to(p.dtype), s)
            self.optimizer.state.pop(p, None)

    def load_masters(self, masters: Sequence[torch.Tensor]) -> None:
        """Replace the master values only (optimizer state untouched), e.g. after the model's
        weights were loaded; ``masters[i]`` any device and float dtype, cast to the master's."""
        self._check_masters(masters)
        for i, (p, m) in enumerate(zip(self._params, masters)):
            if self.device == "nvme":
                self._swapper.swap_out(self._master_key(i), m.to("cpu", p.dtype))
            else:
                p.data.copy_(m)

    def _check_masters(self, masters: Sequence[torch.Tensor]) -> None:
        if len(masters) != len(self._params):
            raise CheckpointError(
                f"checkpoint has {len(masters)} fp32 partitions, this rank has "
                f"{len(self._params)} sub-groups",
                fix=_SAME_LAYOUT,
            )
        for i, (m, s) in enumerate(zip(masters, self._specs)):
            if m.shape != s.shape:
                raise CheckpointError(
                    f"fp32 partition {i} has shape {tuple(m.shape)}, expected {tuple(s.shape)}",
                    fix=_SAME_LAYOUT,
                )

    def resident_tensors(self) -> list[torch.Tensor]:
        """Every tensor of masters and optimizer states in memory now: the masters and state
        with ``none``/``cpu``; with ``nvme`` the pool slots (which hold the resident
        sub-groups), scalar state and tensors waiting to be written. Safe to call from
        ``on_updated``."""
        out = [slot.buf for slot in self._slots if slot.buf is not None]
        for p in self._params:
            out.append(p.data)
            out += [v for v in self.optimizer.state.get(p, {}).values() if torch.is_tensor(v)]
        for rec in list(self._records.values()):
            out += [v for v in rec.small.values() if torch.is_tensor(v)]
        for ts in list(self._inflight.values()):
            out += ts
        return out

    def resident_state_bytes(self) -> int:
        """Bytes of :meth:`resident_tensors`, each storage counted once."""
        seen: dict[int, int] = {}
        for t in self.resident_tensors():
            st = t.untyped_storage()
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        seen.pop(0, None)  # empty tensors
        return sum(seen.values())

    def total_state_bytes(self) -> int:
        """Bytes of all masters and optimizer states, wherever they are."""
        if self.device != "nvme":
            return self.resident_state_bytes()
        total = sum(s.nbytes for s in self._specs)
        for i, rec in list(self._records.items()):
            total += self._swapper.nbytes(self._state_key(i)) if rec.swapped else 0
            total += sum(
                v.untyped_storage().nbytes()
                for v in rec.small.values()
                if isinstance(v, torch.Tensor)
            )
        return total

    def bytes_on_disk(self) -> int:
        return 0 if self._swapper is None else self._swapper.bytes_on_disk()

    def close(self) -> None:
        """Stop the I/O thread and delete the swap files (the optimizer is unusable after)."""
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None
        if self._swapper is not None:
            self._swapper.cleanup()

    # ---- cpu -------------------------------------------------------------------------------

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu" and (not self._pin or t.is_pinned()):
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self._pin)
        host.copy_(t)
        return host

    def _grad_for(self, p: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        if g.device != p.device and p.device.type == "cpu":
            # Copy the (maybe 16-bit) gradient as it is, through pinned memory; cast on the host.
            host = torch.empty(g.shape, dtype=g.dtype, pin_memory=self._pin)
            host.copy_(g)
            g = host
        return g.to(device=p.device, dtype=p.dtype).view(p.shape)

    def _grad_list(self, grads: Grads) -> list[torch.Tensor | None]:
        n = len(self._params)
        if isinstance(grads, Mapping):
            bad = [i for i in grads if not 0 <= i < n]
            if bad:
                raise IndexError(f"grads for sub-groups {bad}: there are {n}")
            return [grads.get(i) for i in range(n)]
        grads = list(grads)
        if len(grads) != n:
            raise ValueError(f"{len(grads)} grads for {n} sub-groups")
        return grads

    # ---- nvme ------------------------------------------------------------------------------

    @staticmethod
    def _master_key(i: int) -> str:
        return f"master{i}"

    @staticmethod
    def _state_key(i: int) -> str:
        return f"state{i}"

    def _write(self, i: int, master: torch.Tensor, state: Mapping[str, Any] | None) -> None:
        """Swap out sub-group ``i``: master to its file, full-size state tensors to another."""
        self._swapper.swap_out(self._master_key(i), master)
        if not state:
            self._records.pop(i, None)
            self._swapper.release(self._state_key(i))
            return
        shape = self._specs[i].shape
        order = list(state)
        swapped = [
            k for k in order if isinstance(state[k], torch.Tensor) and state[k].shape == shape
        ]
        small = {k: state[k] for k in order if k not in swapped}
        if swapped:
            self._swapper.swap_out(self._state_key(i), [state[k] for k in swapped])
        else:
            self._swapper.release(self._state_key(i))
        self._records[i] = _Record(order, swapped, small)

    def _executor(self) -> ThreadPoolExecutor:
        if self._io is None:  # one thread: tasks run in submission order, which the slots rely on
            self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerotron-swap")
        return self._io

    def _carve(self, i: int, slot: _Slot, with_state: bool) -> list[torch.Tensor]:
        # On the main thread, so slots come from the same malloc arena as torch's own
        # allocations (the first step's fresh state): freed memory gets reused, RSS stays flat.
        specs = [self._specs[i]]
        rec = self._records.get(i)
        if with_state and rec is not None and rec.swapped:
            specs += self._swapper.specs(self._state_key(i))
        return slot.carve(specs)

    def _read(self, i: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        self._swapper.swap_in(self._master_key(i), tensors[0])
        if len(tensors) > 1:
            self._swapper.swap_in(self._state_key(i), tensors[1:])
        return tensors

    def _stream(
        self, indices: Sequence[int], with_state: bool
    ) -> Iterator[tuple[int, list[torch.Tensor]]]:
        """Yield ``(i, [master, *swapped state])`` for each index, reading up to
        ``buffer_count - 1`` ahead. The consumer may submit writes for ``i`` before advancing:
        the next read into the same slot is queued behind them on the one I/O thread."""
        io, nslots = self._executor(), len(self._slots)
        indices = list(indices)
        reads: dict[int, Future] = {}

        def submit(k: int) -> None:
            if k < len(indices):
                tensors = self._carve(indices[k], self._slots[k % nslots], with_state)
                reads[k] = io.submit(self._read, indices[k], tensors)

        for k in range(nslots - 1):
            submit(k)
        try:
            for k, i in enumerate(indices):
                submit(k + nslots - 1)  # into the slot of k-1, after k-1's writes
                tensors = reads.pop(k).result()
                yield i, tensors
                del tensors
        finally:
            for f in reads.values():  # stop cleanly on error or an abandoned generator
                f.cancel()
            for f in reads.values():
                with contextlib.suppress(Exception):
                    if not f.cancelled():
                        f.result()

    def _step_nvme(
        self,
        grads: list[torch.Tensor | None],
        on_updated: Callable[[int, torch.Tensor], None] | None,
    ) -> None:
        io = self._executor()
        writes: list[Future] = []
        groups = self.optimizer.param_groups
        saved_params = [g["params"] for g in groups]
        todo = [i for i, g in enumerate(grads) if g is not None]
        try:
            for g in groups:
                g["params"] = []
            with contextlib.closing(self._stream(todo, with_state=True)) as stream:
                for i, tensors in stream:
                    master, state = self._step_one(i, tensors, grads[i], on_updated)
                    self._inflight[i] = [master, *(v for v in state.values() if torch.is_tensor(v))]
                    writes.append(io.submit(self._write_inflight, i, master, state))
                    del tensors, master, state  # the write task holds them until written
        finally:
            for g, ps in zip(groups, saved_params):
                g["params"] = ps
            errors = []
            for f in writes:
                try:
                    f.result()
                except Exception as e:  # report the first; the rest are usually the same disk
                    errors.append(e)
            if errors:
                raise errors[0]

    def _step_one(
        self,
        i: int,
        tensors: list[torch.Tensor],
        grad: torch.Tensor,
        on_updated: Callable[[int, torch.Tensor], None] | None,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Step resident sub-group ``i`` alone; return its master and state to write back."""
        p, rec, group = self._params[i], self._records.get(i), self._group_of[i]
        p.data = tensors[0]
        try:
            if rec is not None:
                swapped = dict(zip(rec.swapped, tensors[1:]))
                self.optimizer.state[p] = {
                    k: swapped[k] if k in swapped else rec.small[k] for k in rec.order
                }
            p.grad = self._grad_for(p, grad)
            self.optimizer.param_groups[group]["params"] = [p]
            self.optimizer.step()
            if on_updated is not None:
                on_updated(i, p.data)
            return p.data, self.optimizer.state.pop(p, {})
        finally:
            self.optimizer.param_groups[group]["params"] = []
            self.optimizer.state.pop(p, None)
            p.grad = None
            p.data = self._placeholders[i]

    def _write_inflight(self, i: int, master: torch.Tensor, state: dict[str, Any]) -> None:
        try:
            self._write(i, master, state)
        finally:
            self._inflight.pop(i, None)


def _default_rank_name() -> str:
    dist = torch.distributed
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return f"rank{rank}"


def _cpu(v: Any) -> Any:
    return v.cpu() if isinstance(v, torch.Tensor) else v


def _cast_like_torch(key: str, v: Any, dtype: torch.dtype) -> Any:
    # torch's Optimizer.load_state_dict casts floating state to the param's dtype, except "step".
    if isinstance(v, torch.Tensor) and key != "step" and v.is_floating_point():
        return v.to(device="cpu", dtype=dtype)
    return v.cpu() if isinstance(v, torch.Tensor) else v


# --------------------------------------------------------------------------------------------
# Parameters (ZeRO-3 offload_param)


class ParamStore:
    """ZeRO-3 ``offload_param``: this rank's 16-bit parameter shards, kept by key.

    - ``none``: keeps the tensor it was given (no copy).
    - ``cpu``: keeps a host copy (pinned with ``pin_memory``), reusing its buffer on each put.
    - ``nvme``: keeps a file per key (checked writes, see :class:`NVMeSwapper`).

    :meth:`get` returns the stored tensor itself for ``none``/``cpu`` (treat it as read-only;
    :meth:`put` to change it) and a fresh tensor (or ``out``) for ``nvme``.
    """

    def __init__(
        self,
        options: OffloadOptions,
        rank_name: str | None = None,
        *,
        where: str = "zero_optimization.offload_param",
    ):
        options.validate(where)
        rank_name = rank_name or _default_rank_name()
        self.options = options
        self.device = options.device
        self._pin = options.pin_memory and torch.cuda.is_available()
        self._held: dict[str, torch.Tensor] = {}
        self._swapper = (
            NVMeSwapper(options.nvme_path, f"{rank_name}.params", where=f"{where}.nvme_path")
            if self.device == "nvme"
            else None
        )

    def put(self, key: str | int, tensor: torch.Tensor) -> None:
        """Store ``tensor``'s values under ``key`` (replacing what was there)."""
        key = str(key)
        if self.device == "nvme":
            self._swapper.swap_out(key, tensor)
        elif self.device == "cpu":
            held = self._held.get(key)
            if held is None or held.shape != tensor.shape or held.dtype != tensor.dtype:
                held = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self._pin)
                self._held[key] = held
            held.copy_(tensor.detach())
        else:
            self._held[key] = tensor

    def get(self, key: str | int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The values stored under ``key``; copied into ``out`` (any device) if given."""
        key = str(key)
        if self.device == "nvme":
            if out is not None and out.device.type == "cpu" and out.is_contiguous():
                return self._swapper.swap_in(key, out)
            t = self._swapper.swap_in(key)
            return t if out is None else out.copy_(t)
        t = self._held[key]
        return t if out is None else out.copy_(t)

    def __contains__(self, key: str | int) -> bool:
        key = str(key)
        return key in self._swapper if self._swapper is not None else key in self._held

    def release(self, key: str | int) -> None:
        """Forget ``key`` (and delete its file)."""
        key = str(key)
        if self._swapper is not None:
            self._swapper.release(key)
        self._held.pop(key, None)

    def resident_bytes(self) -> int:
        """Bytes held in memory (0 with ``nvme``: nothing is kept between calls)."""
        return sum(t.numel() * t.element_size() for t in self._held.values())

    def bytes_on_disk(self) -> int:
        return 0 if self._swapper is None else self._swapper.bytes_on_disk()

    def close(self) -> None:
        """Drop everything and delete the swap files."""
        self._held.clear()
        if self._swapper is not None:
            self._swapper.cleanup()

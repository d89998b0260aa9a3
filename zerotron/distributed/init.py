"""Join the job's processes: env:// rendezvous, backend choice, device, timeout.

``zerotron launch`` and ``torchrun`` start one process per rank and describe the job in the
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).
:func:`init_distributed` reads it and creates the default process group; a plain
``python script.py`` (no ``WORLD_SIZE``, or ``WORLD_SIZE=1``) is one process and creates none,
so single-process code pays nothing and every collective in :mod:`zerotron.distributed.comm`
is a no-op. DeepSpeed's entry points ask for ``single_process_group=True``: a one-process run
then gets a default group of its own (rank 0 of 1, an in-memory store: no port, no file), so a
script's own ``torch.distributed.get_rank()``, ``barrier()`` or ``DistributedSampler`` works as
under DeepSpeed; zerotron's collectives on it stay no-ops (one rank).

Backend: nccl when the device is CUDA, gloo otherwise. The timeout
(``--distributed-timeout-minutes``) bounds every collective and point-to-point wait, on the
default group and on every group made with :func:`new_group` (torch's own ``new_group`` would
give a group its 30-minute default): when a rank dies, raises or stops, the others fail with a
:class:`DistributedError` naming it (:mod:`zerotron.distributed.liveness`) instead of waiting.

A process group created here is destroyed again at interpreter exit (``atexit``), also when the
program ends on an exception: without that, a gloo worker's shutdown sometimes aborts the
process after the traceback. A group someone else created is left alone.
"""

from __future__ import annotations

import atexit
import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from zerotron.distributed import liveness, watchdog
from zerotron.errors import DistributedError

BACKENDS = ("gloo", "nccl")
_LAUNCH_FIX = "start the job with `zerotron launch` or `torchrun`, which set these variables"
_teardown_registered = False  # atexit holds _destroy_at_exit (registered once per process)
_timeout: timedelta | None = None  # the job's timeout, given to every group made here


def is_initialized() -> bool:
    """Whether a default process group exists (False for a single-process run)."""
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    """Global rank of this process (0 without a process group)."""
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    """Number of processes in the job (1 without a process group)."""
    return dist.get_world_size() if is_initialized() else 1


def local_rank() -> int:
    """Rank of this process on its node (``LOCAL_RANK``; 0 when unset)."""
    return _env_int("LOCAL_RANK", default=0)


def init_distributed(
    backend: str | None = None,
    timeout_minutes: float = 10,
    device: str | None = None,
    single_process_group: bool = False,
) -> tuple[int, int]:
    """Create the default process group from the launcher's environment; return (rank, world).

    ``device`` is ``"cuda"`` or ``"cpu"`` (default: cuda when available). ``backend`` defaults
    to nccl for cuda and gloo for cpu. On cuda the current device becomes ``LOCAL_RANK``.
    ``timeout_minutes`` may be a fraction (tests use seconds). Calling it again returns the
    existing (rank, world size). A one-process run creates no group unless
    ``single_process_group`` (DeepSpeed's behaviour: a group of one).
    """
    if is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if timeout_minutes <= 0:
        raise DistributedError(
            f"timeout must be positive, got {timeout_minutes} minutes",
            where="--distributed-timeout-minutes",
        )
    device = _pick_device(device)
    backend = backend or ("nccl" if device == "cuda" else "gloo")
    if backend not in BACKENDS:
        raise DistributedError(
            f"unknown backend {backend!r}",
            where="init_distributed",
            fix=f"use one of {', '.join(BACKENDS)}",
        )
    if backend == "nccl" and device != "cuda":
        raise DistributedError(
            "the nccl backend needs CUDA tensors", where="init_distributed", fix="use gloo on CPU"
        )
    if device == "cuda":
        _set_cuda_device()

    world = _env_int("WORLD_SIZE") if "WORLD_SIZE" in os.environ else 1
    if world == 1:
        if single_process_group:
            _init_single(backend, timedelta(minutes=timeout_minutes))
        return 0, 1
    rank = _env_int("RANK")
    if not 0 <= rank < world:
        raise DistributedError(f"RANK={rank} is outside 0..{world - 1}", where="environment")
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(var):
            raise DistributedError(
                f"{var} is not set (WORLD_SIZE={world})", where="environment", fix=_LAUNCH_FIX
            )
    global _timeout
    _timeout = timedelta(minutes=timeout_minutes)
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        world_size=world,
        rank=rank,
        timeout=_timeout,
        # nccl: bind the communicator to this rank's GPU now, not at the first collective.
        device_id=torch.device("cuda", local_rank()) if backend == "nccl" else None,
    )
    _register_teardown()
    liveness.start(_default_store(), rank, _timeout.total_seconds())
    watchdog.start(rank, _timeout.total_seconds())
    return rank, world


def _init_single(backend: str, limit: timedelta) -> None:
    """The default group of a one-process run: rank 0 of 1 over an in-memory store.

    A store in this process needs no port and no file, so concurrent runs (tests) cannot
    collide, and nothing is left behind; the group is destroyed at exit like any other.
    """
    global _timeout
    _timeout = limit
    dist.init_process_group(
        backend=backend,
        store=dist.HashStore(),
        world_size=1,
        rank=0,
        timeout=_timeout,
        device_id=torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None,
    )
    _register_teardown()


def timeout() -> timedelta:
    """The bound on every collective: the job's ``--distributed-timeout-minutes``.

    For a process group someone else created, torch's default for its backend.
    """
    if _timeout is not None:
        return _timeout
    backend = dist.get_backend() if is_initialized() else "gloo"
    return dist.distributed_c10d._get_default_timeout(backend)


def new_group(ranks: list[int]) -> object:
    """``dist.new_group`` with the job's timeout (collective: every rank calls it, in order)."""
    return dist.new_group(ranks, timeout=timeout())


def _default_store() -> object | None:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):  # no store to publish in: no heartbeat
        return None


def _register_teardown() -> None:
    """Destroy the process group at exit, once per process (only :func:`init_distributed`'s)."""
    global _teardown_registered
    if not _teardown_registered:
        atexit.register(_destroy_at_exit)
        _teardown_registered = True


def _destroy_at_exit() -> None:
    # At exit nothing can be done about a failing teardown; the exit status is already decided.
    try:
        if is_initialized():
            # Models with hooks (ZeRO-3's gather/release closures) sit in reference cycles that
            # hold tensors and collective handles; left to interpreter finalization they are
            # destroyed after the process group, which aborted gloo's teardown now and then
            # ("terminate called without an active exception"). Collect them while it lives.
            gc.collect()
            destroy()
    except Exception:  # noqa: BLE001 - best effort at interpreter exit
        pass


def destroy() -> None:
    """Tear down the model-parallel groups and the default process group (if any)."""
    # Imported here: state builds on this module, not the other way round.
    from zerotron.distributed.state import destroy_model_parallel

    global _timeout
    destroy_model_parallel()
    liveness.stop()
    watchdog.stop()
    if is_initialized():
        dist.destroy_process_group()
    _timeout = None


def _pick_device(device: str | None) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = device.split(":")[0]
    if kind not in ("cpu", "cuda"):
        raise DistributedError(f"unknown device {device!r}", fix="use 'cpu' or 'cuda'")
    if kind == "cuda" and not torch.cuda.is_available():
        raise DistributedError(
            "device 'cuda' asked for, but CUDA is not available",
            where="init_distributed",
            fix="run on CPU (gloo) or on a machine with GPUs",
        )
    return kind


def _set_cuda_device() -> None:
    index, count = local_rank(), torch.cuda.device_count()
    if index >= count:
        raise DistributedError(
            f"LOCAL_RANK={index} but only {count} GPU(s) are visible",
            where="environment",
            fix=f"start at most {count} processes per node (--nproc_per_node)",
        )
    torch.cuda.set_device(index)


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        if default is None:
            raise DistributedError(f"{name} is not set", where="environment", fix=_LAUNCH_FIX)
        return default
    try:
        number = int(value)
    except ValueError:
        raise DistributedError(
            f"{name}={value!r} is not an integer", where="environment", fix=_LAUNCH_FIX
        ) from None
    if number < 0 or (name == "WORLD_SIZE" and number < 1):
        raise DistributedError(f"{name}={number} is out of range", where="environment")
    return number

"""Which device-specific fast paths run: one policy per device type, each path with an off switch.

The model, the linear layers and the Engine ask :func:`kernel_policy` (with the device their
tensors live on) instead of testing for a device themselves, so every CPU-tuned choice sits here.
On CUDA (and any device other than the CPU) every field is False: the model takes the plain
PyTorch path (SDPA with its flash kernel, ``F.cross_entropy`` over the logits, which
``torch.compile`` traces whole), with no forced graph break.

Fields, their off switches, and the plain twin each fast path must equal (tests/ compare them):

- ``onednn_linear`` (``ZEROTRON_ONEDNN=0``): fp32 matmuls of the linear layers and of the fused
  loss on oneDNN rather than torch.mm (:mod:`~zerotron.kernels.onednn`); twin ``F.linear``.
- ``upcast_16bit`` (``ZEROTRON_UPCAST_16BIT=0``): 16-bit matmuls of the linear layers and of
  the fused loss by the fp32 GEMM on upcast copies, where 16-bit GEMMs are emulated
  (:mod:`~zerotron.kernels.upcast`); twin torch's own 16-bit matmul.
- ``attention_16bit`` (``ZEROTRON_MATH_ATTENTION=0``): 16-bit attention without dropout by
  SDPA's MATH kernel kept in 16 bits (:mod:`~zerotron.kernels.attention_cpu`); twin SDPA with
  the backend it picks.
- ``attention_fp32`` (the same switch): 16-bit attention without dropout by SDPA on fp32 copies,
  rounded back (:func:`~zerotron.kernels.attention_cpu.sdpa_fp32`); the same twin.
- ``fused_loss`` (``ZEROTRON_FUSED_LOSS=0``): at TP=1 the output layer and the loss fused in
  token chunks (:mod:`~zerotron.kernels.fused_cross_entropy`), eager under ``torch.compile``,
  and with ``eager_embedding`` the tied embedding's two gradients summed in place
  (:mod:`~zerotron.kernels.tied_grad`); twin ``F.cross_entropy`` over ``F.linear``'s logits.
- ``eager_embedding`` (``ZEROTRON_EAGER_EMBEDDING=0``): the word-embedding lookup left out of
  the compiled graph (inductor's compiled embedding backward is slow on CPU); twin: compiled.
- ``keep_freed_heap`` (``ZEROTRON_KEEP_HEAP=0``, read by
  :func:`~zerotron.kernels.malloc.keep_freed_heap` itself): glibc keeps its freed heap between
  steps, in a one-process job (applied by :func:`apply_process_settings`).

An off switch is read whenever the policy is asked (under ``torch.compile``: when the graph is
traced), so ``ZEROTRON_FUSED_LOSS=0 zerotron pretrain ...`` runs the plain path on the CPU, to
compare or to bisect. Why each fast path exists and what it gains is measured in bench/README.md.

Which of two candidates wins on a given CPU is not a property of its vendor: the process-wide
:class:`KernelChoices` (:func:`set_choices`, made by :mod:`~zerotron.kernels.chooser` from
timings of the model's own shapes) narrow the policy further. ``onednn_linear`` holds only where
the choice ``linear`` is ``onednn``, ``upcast_16bit`` only where ``matmul16`` is ``fp32``,
``attention_16bit`` only where ``attention`` is ``math16``, ``attention_fp32`` only where it is
``fp32``, and the fp32 fused loss cuts its oneDNN products in ``loss_chunk`` vocabulary columns.
Until a choice is made the defaults below hold (every fast path on but the upcast 16-bit matmuls
and the fp32 attention, 2,048 columns).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from zerotron.kernels.malloc import keep_freed_heap

ENV_SWITCHES = {
    "onednn_linear": "ZEROTRON_ONEDNN",
    "upcast_16bit": "ZEROTRON_UPCAST_16BIT",
    "attention_16bit": "ZEROTRON_MATH_ATTENTION",
    "attention_fp32": "ZEROTRON_MATH_ATTENTION",
    "fused_loss": "ZEROTRON_FUSED_LOSS",
    "eager_embedding": "ZEROTRON_EAGER_EMBEDDING",
}


@dataclass(frozen=True)
class KernelPolicy:
    """The fast paths one device type takes (see the module docstring for each field)."""

    onednn_linear: bool = False
    upcast_16bit: bool = False
    attention_16bit: bool = False
    attention_fp32: bool = False
    fused_loss: bool = False
    eager_embedding: bool = False
    keep_freed_heap: bool = False


@dataclass(frozen=True)
class KernelChoices:
    """The CPU candidates this process runs, one per machine-dependent choice.

    ``linear``: the fp32 linear layers' (and fp32 fused loss's) matmuls, ``"onednn"`` or
    ``"torch"`` (torch.mm); ``matmul16``: their 16-bit matmuls, ``"native"`` (torch's 16-bit
    GEMM) or ``"fp32"`` (:mod:`~zerotron.kernels.upcast`); ``attention``: 16-bit attention
    without dropout, ``"math16"``
    (:func:`~zerotron.kernels.attention_cpu.sdpa_math_16bit`), ``"sdpa"`` (SDPA's own pick) or
    ``"fp32"`` (:func:`~zerotron.kernels.attention_cpu.sdpa_fp32`);
    ``loss_chunk``: vocabulary columns per oneDNN product slice of the fp32 fused loss.
    """

    linear: str = "onednn"
    matmul16: str = "native"
    attention: str = "math16"
    loss_chunk: int = 2048


_choices = KernelChoices()


def set_choices(choices: KernelChoices) -> None:
    """Make ``choices`` this process's kernel choices (read whenever the policy is asked)."""
    global _choices
    _choices = choices


def current_choices() -> KernelChoices:
    """This process's kernel choices (the defaults until :func:`set_choices`)."""
    return _choices


@contextlib.contextmanager
def using_choices(choices: KernelChoices) -> Iterator[None]:
    """``choices`` in effect inside the block, the previous ones restored after it."""
    before = current_choices()
    set_choices(choices)
    try:
        yield
    finally:
        set_choices(before)


def kernel_policy(device: torch.device | str) -> KernelPolicy:
    """The fast paths for tensors on ``device``: on the CPU those the current
    :class:`KernelChoices` pick (less those switched off by their environment variable), none
    elsewhere."""
    device_type = device if isinstance(device, str) else device.type
    if device_type != "cpu":
        return KernelPolicy()
    switches = {field: _on(env) for field, env in ENV_SWITCHES.items()}
    choices = current_choices()
    switches["onednn_linear"] &= choices.linear == "onednn"
    switches["upcast_16bit"] &= choices.matmul16 == "fp32"
    switches["attention_16bit"] &= choices.attention == "math16"
    switches["attention_fp32"] &= choices.attention == "fp32"
    return KernelPolicy(**switches, keep_freed_heap=True)


def apply_process_settings(device: torch.device | str, world_size: int) -> None:
    """Process-wide settings for a training job on ``device`` with ``world_size`` processes.

    Today glibc's kept heap (:func:`~zerotron.kernels.malloc.keep_freed_heap`), on the CPU in a
    one-process job only: ranks sharing a host's memory keep glibc's defaults.
    """
    if world_size == 1 and kernel_policy(device).keep_freed_heap:
        keep_freed_heap()


def _on(env: str) -> bool:
    return os.environ.get(env, "1") != "0"

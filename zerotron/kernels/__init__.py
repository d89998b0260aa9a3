"""Device-specific fast paths behind one device-keyed policy, each with a plain twin it equals.

- :mod:`~zerotron.kernels.policy`: :func:`kernel_policy` (which fast paths a device takes, and
  their off switches) and :func:`apply_process_settings` (process-wide settings of a job).
- :mod:`~zerotron.kernels.chooser`: :func:`choose_kernels`, the CPU candidates timed on the
  model's shapes at first use on a machine and cached (:mod:`~zerotron.kernels.measure` holds
  the timed calls), or forced by ``ZEROTRON_KERNELS`` / ``--kernels``.
- :mod:`~zerotron.kernels.onednn`: fp32 CPU matmuls on oneDNN (:func:`linear`, the linear
  layers' ``F.linear``).
- :mod:`~zerotron.kernels.upcast`: 16-bit CPU matmuls on the fp32 GEMM, where 16-bit GEMMs
  are emulated.
- :mod:`~zerotron.kernels.attention_cpu`: 16-bit CPU attention, SDPA's MATH kernel kept in
  16 bits (:func:`sdpa_math_16bit`) or SDPA on fp32 copies (:func:`sdpa_fp32`).
- :mod:`~zerotron.kernels.fused_cross_entropy`: the output layer and the cross entropy fused in
  token chunks (:func:`fused_linear_cross_entropy`), and :mod:`~zerotron.kernels.tied_grad`,
  the tied embedding's two gradients summed in place.
- :mod:`~zerotron.kernels.malloc`: glibc's freed heap kept between steps.

This package imports nothing of zerotron's outside itself but the bottom layers (errors, fileio:
the chooser's cache; distributed.comm: one choice for a job's ranks): the parallel layers, the
models and the Engine choose among these paths by asking the policy.
"""

from zerotron.kernels.attention_cpu import sdpa_fp32, sdpa_math_16bit
from zerotron.kernels.chooser import Chosen, KernelShape, choose_kernels
from zerotron.kernels.fused_cross_entropy import ChunkWorkspace, fused_linear_cross_entropy
from zerotron.kernels.onednn import linear, use_onednn
from zerotron.kernels.policy import (
    KernelChoices,
    KernelPolicy,
    apply_process_settings,
    current_choices,
    kernel_policy,
    set_choices,
)
from zerotron.kernels.tied_grad import TiedGrad, embedding_lookup

__all__ = [
    "ChunkWorkspace",
    "Chosen",
    "KernelChoices",
    "KernelPolicy",
    "KernelShape",
    "TiedGrad",
    "apply_process_settings",
    "choose_kernels",
    "current_choices",
    "embedding_lookup",
    "fused_linear_cross_entropy",
    "kernel_policy",
    "linear",
    "sdpa_fp32",
    "sdpa_math_16bit",
    "set_choices",
    "use_onednn",
]

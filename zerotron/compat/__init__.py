"""DeepSpeed's public API as thin facades over zerotron's layers.

Each module here is one DeepSpeed module, reachable under its DeepSpeed name at the top level:
``zerotron.<name>`` is ``zerotron.compat.<name>`` (the same module object, submodules
included) for every name in :data:`zerotron.COMPAT_MODULES`, so ``import zerotron as deepspeed``
runs a DeepSpeed script:

- :mod:`~zerotron.compat.accelerator`: ``deepspeed.accelerator`` (``get_accelerator()``: the
  CPU or CUDA device as DeepSpeed's accelerator interface describes it);
- :mod:`~zerotron.compat.checkpointing`: ``deepspeed.checkpointing`` (activation recompute,
  whose machinery is :mod:`zerotron.parallel.recompute`);
- :mod:`~zerotron.compat.comm`: ``deepspeed.comm`` (torch.distributed's functions with
  DeepSpeed's signatures and ``ReduceOp``, through :mod:`zerotron.distributed.comm` and its
  ledger; ``init_distributed``);
- :mod:`~zerotron.compat.ops`: ``deepspeed.ops`` (``DeepSpeedCPUAdam``, ``FusedAdam``,
  ``DeepSpeedCPUAdagrad``, ``DeepSpeedCPULion``, ``FusedLion`` over :mod:`zerotron.optim`);
- :mod:`~zerotron.compat.pipe`: ``deepspeed.pipe`` (``PipelineModule``, ``LayerSpec``,
  ``TiedLayerSpec`` on :mod:`zerotron.pipeline`);
- :mod:`~zerotron.compat.runtime`: ``deepspeed.runtime`` (``set_random_seed``,
  ``DeepSpeedEngine``, LR schedule names, ``ZeroParamStatus``, the ZeRO memory estimators on
  :mod:`zerotron.tuning`);
- :mod:`~zerotron.compat.utils`: ``deepspeed.utils`` (``logger``, ``log_dist``, ``groups``,
  ``safe_get_full_*``, ZeRO-3 leaf modules, ``zero_to_fp32``);
- :mod:`~zerotron.compat.compression`: ``deepspeed.compression.helper``;
- :mod:`~zerotron.compat.moe`: ``deepspeed.moe`` (importable; no MoE layer yet).

Beside them, for Hugging Face transformers/accelerate (docs/huggingface.md):
:mod:`~zerotron.compat.as_deepspeed` (``zerotron launch --as-deepspeed``: a program whose
``import deepspeed`` is zerotron, through the ``deepspeed_alias/`` directory) and
:mod:`~zerotron.compat.hf` (accelerate's DeepSpeed runs on CPU-only hosts, under the alias).

To add a DeepSpeed module: put it here as ``compat/<name>.py`` (or a package) and add ``<name>``
to ``COMPAT_MODULES`` in ``zerotron/__init__.py``. Nothing else imports this package's
``__init__``, so keep it free of imports: ``import zerotron`` stays cheap.
"""

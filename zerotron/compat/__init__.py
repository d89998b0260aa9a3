"""DeepSpeed's public API as thin facades over zerotron's layers.

Each module here is one DeepSpeed module, reachable under its DeepSpeed name at the top level:
``zerotron.<name>`` is ``zerotron.compat.<name>`` (the same module object, submodules
included) for every name in :data:`zerotron.COMPAT_MODULES`, so ``import zerotron as deepspeed``
runs a DeepSpeed script:

- :mod:`~zerotron.compat.checkpointing`: ``deepspeed.checkpointing`` (activation recompute,
  whose machinery is :mod:`zerotron.parallel.recompute`);
- :mod:`~zerotron.compat.ops`: ``deepspeed.ops`` (``DeepSpeedCPUAdam``, ``FusedAdam``,
  ``DeepSpeedCPUAdagrad``, ``DeepSpeedCPULion``, ``FusedLion`` over :mod:`zerotron.optim`);
- :mod:`~zerotron.compat.pipe`: ``deepspeed.pipe`` (``PipelineModule``, ``LayerSpec``,
  ``TiedLayerSpec`` on :mod:`zerotron.pipeline`).

To add a DeepSpeed module: put it here as ``compat/<name>.py`` (or a package) and add ``<name>``
to ``COMPAT_MODULES`` in ``zerotron/__init__.py``. Nothing else imports this package's
``__init__``, so keep it free of imports: ``import zerotron`` stays cheap.
"""

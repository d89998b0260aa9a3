"""The Engine and the one place it is assembled.

- :mod:`~zerotron.engine.core`: :class:`Engine`, the object a training loop talks to;
- :mod:`~zerotron.engine.deepspeed_surface`: the rest of DeepSpeed's engine surface (a mixin of
  the Engine: nn.Module fall-through, ranks, config questions, step results, 16-bit saving);
- :mod:`~zerotron.engine.output_grads`: ``loss.backward()`` on the Engine's outputs done as
  ``engine.backward(loss)`` does it;
- :mod:`~zerotron.engine.protocols`: the parts it composes (optimizer, data parallel, pipeline,
  checkpoint fitter), as the protocols it calls them by;
- :mod:`~zerotron.engine.optimizers`: the optimizer parts (mixed precision, ZeRO 1-2, ZeRO 3);
- :mod:`~zerotron.engine.builder`: :func:`build_engine`, called by ``zerotron pretrain``,
  ``initialize()`` and ``pipeline_engine()``;
- :mod:`~zerotron.engine.checkpoint_io`: what an Engine saves and loads;
- :mod:`~zerotron.engine.timers` and :mod:`~zerotron.engine.monitors`;
- :mod:`~zerotron.engine.run_metrics`: the run's metrics file, as the Engine writes it;
- :mod:`~zerotron.engine.memory_breakdown`: what one step holds, per term of the estimator.
"""

from zerotron.engine.builder import OptimizerSetup, build_engine, grad_norm_hooks
from zerotron.engine.core import Engine

__all__ = ["Engine", "OptimizerSetup", "build_engine", "grad_norm_hooks"]

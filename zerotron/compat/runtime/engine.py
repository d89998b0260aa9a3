"""DeepSpeed's ``deepspeed.runtime.engine``: ``DeepSpeedEngine`` is the class of the engine
``initialize()`` returns, :class:`zerotron.engine.Engine`, so ``isinstance(engine,
DeepSpeedEngine)`` holds for it."""

from zerotron.engine import Engine

DeepSpeedEngine = Engine

__all__ = ["DeepSpeedEngine"]

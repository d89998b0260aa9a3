"""DeepSpeed's ``deepspeed.compression`` (importable as ``zerotron.compression``): only the
module helpers scripts import (:mod:`~zerotron.compat.compression.helper`); DeepSpeed's
compression training (quantization, pruning schedules) does not exist in zerotron."""

"""Multi-process tests: each spawns a few gloo ranks on CPU with :mod:`tests.distributed.spawn`."""

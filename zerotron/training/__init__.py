"""The pretraining loop, evaluation, logging, timers and throughput."""

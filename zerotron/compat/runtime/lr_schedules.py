"""DeepSpeed's ``deepspeed.runtime.lr_schedules``: the schedule names and classes
(:mod:`zerotron.optim.ds_schedulers` holds them, with DeepSpeed's formulas and timing)."""

from zerotron.optim.ds_schedulers import (
    DS_SCHEDULERS,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
)

LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
"""The ``scheduler.type`` values a DeepSpeed config accepts (DeepSpeed's list, in its order)."""

assert set(VALID_LR_SCHEDULES) == set(DS_SCHEDULERS)  # one list of schedules, two spellings

__all__ = [
    "LR_RANGE_TEST",
    "ONE_CYCLE",
    "VALID_LR_SCHEDULES",
    "WARMUP_COSINE_LR",
    "WARMUP_DECAY_LR",
    "WARMUP_LR",
    "LRRangeTest",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
]

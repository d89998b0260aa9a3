"""``"auto"`` in a DeepSpeed config (as Hugging Face writes them): the value it stands for,
from what the caller knows (:class:`AutoValues`), else DeepSpeed's default."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerotron.config.deepspeed_table import REQUIRED, Leaf
from zerotron.errors import ConfigError


@dataclass
class AutoValues:
    """What ``"auto"`` values resolve from (Hugging Face's conventions where they exist).

    ``args`` is the script's namespace: its ``train_micro_batch_size_per_gpu`` /
    ``per_device_train_batch_size`` / ``micro_batch_size`` / ``batch_size``,
    ``gradient_accumulation_steps``, ``train_batch_size``, ``lr`` / ``learning_rate``,
    ``weight_decay``, ``adam_beta1``/``adam_beta2``, ``adam_eps``/``adam_epsilon``,
    ``clip_grad``/``max_grad_norm``, ``fp16``/``bf16``, ``warmup_steps``/``warmup_num_steps``,
    ``train_iters``/``total_num_steps``/``max_steps`` are used when present.
    ``optimizer_lr`` is a passed optimizer's learning rate; ``hidden_size`` the model's (for
    the bucket sizes Hugging Face derives from it).
    """

    args: Any = None
    optimizer_lr: float | None = None
    hidden_size: int | None = None

    def arg(self, *names: str) -> Any:
        for name in names:
            value = getattr(self.args, name, None) if self.args is not None else None
            if value is not None:
                return value
        return None


def auto_leaf(path: str, leaf: Leaf, auto: AutoValues) -> Any:
    """The value "auto" stands for at ``path`` (None: leave the key out)."""
    h = auto.hidden_size
    name = path.rsplit(".", 1)[-1]
    by_arg = {
        "train_batch_size": ("train_batch_size",),
        "train_micro_batch_size_per_gpu": (
            "train_micro_batch_size_per_gpu",
            "per_device_train_batch_size",
            "micro_batch_size",
            "batch_size",
        ),
        "gradient_accumulation_steps": ("gradient_accumulation_steps",),
        "gradient_clipping": ("clip_grad", "max_grad_norm", "gradient_clipping"),
        "fp16.enabled": ("fp16",),
        "bf16.enabled": ("bf16",),
        "bfloat16.enabled": ("bf16",),
        "seed": ("seed",),
    }
    if path in by_arg:
        value = auto.arg(*by_arg[path])
        if value is not None:
            return value
        return leaf.default
    if h is not None and name == "reduce_bucket_size":
        return h * h
    if h is not None and name == "stage3_prefetch_bucket_size":
        return int(0.9 * h * h)
    if h is not None and name == "stage3_param_persistence_threshold":
        return 10 * h
    return leaf.default


def auto_optimizer_param(name: str, default: Any, auto: AutoValues) -> Any:
    if name == "lr":
        return auto.arg("lr", "learning_rate") or default
    if name == "weight_decay":
        value = auto.arg("weight_decay")
        return default if value is None else value
    if name == "betas":
        b1, b2 = auto.arg("adam_beta1"), auto.arg("adam_beta2")
        return default if b1 is None or b2 is None else (b1, b2)
    if name == "eps":
        return auto.arg("adam_eps", "adam_epsilon") or default
    if name == "momentum":
        value = auto.arg("momentum", "sgd_momentum")
        return default if value is None else value
    return default


def auto_scheduler_param(path: str, name: str, default: Any, lr: float, auto: AutoValues) -> Any:
    if name in ("warmup_max_lr", "cycle_max_lr", "lr_range_test_min_lr"):
        return lr
    if name in ("warmup_min_lr",):
        return 0.0
    if name == "warmup_num_steps":
        value = auto.arg("warmup_num_steps", "warmup_steps", "lr_warmup_iters")
    elif name == "total_num_steps":
        value = auto.arg("total_num_steps", "train_iters", "max_steps")
    else:
        value = None
    if value is not None:
        return value
    if default is REQUIRED or name in ("warmup_num_steps",):
        hint = {
            "warmup_num_steps": "args.warmup_num_steps (or warmup_steps)",
            "total_num_steps": "args.total_num_steps (or train_iters, max_steps)",
        }.get(name, "a value")
        raise ConfigError(
            f"{path}: cannot resolve 'auto'",
            fix=f"write a number, or give {hint} to initialize(args=...)",
        )
    return default


# --------------------------------------------------------------------------------------------
# Loading

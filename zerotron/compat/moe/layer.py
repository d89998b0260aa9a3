"""DeepSpeed's ``deepspeed.moe.layer``: :class:`MoE`, which zerotron does not have yet."""

from __future__ import annotations

from typing import Any

from torch import nn

from zerotron.errors import UnsupportedError


class MoE(nn.Module):
    """DeepSpeed's mixture-of-experts layer: not implemented in zerotron; constructing one
    raises :class:`~zerotron.errors.UnsupportedError`. The class exists so that scripts that
    import it (and use it only when asked to) run."""

    def __init__(
        self, hidden_size: int, expert: nn.Module, num_experts: int = 1, *a: Any, **k: Any
    ):
        raise UnsupportedError(
            f"mixture-of-experts layers (deepspeed.moe.layer.MoE, {num_experts} experts) do "
            "not exist in zerotron yet",
            where="deepspeed.moe.layer.MoE",
            fix="run the script without its MoE option (a dense model), or with DeepSpeed",
        )

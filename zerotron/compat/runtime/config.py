"""DeepSpeed's ``deepspeed.runtime.config``: the optimizer names a config's
``optimizer.type`` may take (lowercase, as DeepSpeed compares them) and the Adam keys, with
DeepSpeed 0.19.8's values. ``DeepSpeedConfig`` itself is refused (the engine answers what it
would: :mod:`zerotron.config.deepspeed_refused`); zerotron's reader of the JSON is
:func:`zerotron.config.load_deepspeed_config`."""

from __future__ import annotations

ADAGRAD_OPTIMIZER = "adagrad"
ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
MUADAM_OPTIMIZER = "muadam"
MUADAMW_OPTIMIZER = "muadamw"
MUSGD_OPTIMIZER = "musgd"
LION_OPTIMIZER = "lion"
MUON_OPTIMIZER = "muon"

DEEPSPEED_OPTIMIZERS = [
    ADAGRAD_OPTIMIZER,
    ADAM_OPTIMIZER,
    ADAMW_OPTIMIZER,
    LAMB_OPTIMIZER,
    MUADAM_OPTIMIZER,
    MUADAMW_OPTIMIZER,
    MUSGD_OPTIMIZER,
    LION_OPTIMIZER,
    MUON_OPTIMIZER,
]
"""DeepSpeed's own optimizer names, in its order (zerotron implements adagrad, adam, adamw,
lamb and lion; the config reader refuses the others by name)."""

TORCH_ADAM_PARAM = "torch_adam"
ADAM_W_MODE = "adam_w_mode"
ADAM_W_MODE_DEFAULT = True

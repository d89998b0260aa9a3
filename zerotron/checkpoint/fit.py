"""How a loaded checkpoint is fitted to the model it is loaded into.

The Engine loads weights (and the optimizer state that goes with them) through a fitter, so it
never needs to know what a model's tensors mean:

- :class:`StateFitter` (the default) loads weights whose shapes match the model exactly, and
  reads a checkpoint of another tensor/pipeline layout by merging and re-splitting its files;
- :class:`VocabPadding` adds what a GPT needs: its embedding rows are the vocabulary padded to a
  multiple that grows with tensor parallelism, so a checkpoint padded differently is not a
  mismatch. The real rows are kept and the padding redone in the weights
  (:func:`~zerotron.checkpoint.state.repad_vocab`) and in the optimizer state that follows them
  (Adam's moments, fp32 masters).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from zerotron.checkpoint.reshard import load_model_state_for
from zerotron.checkpoint.state import load_model_state, repad_vocab
from zerotron.distributed.state import ParallelState
from zerotron.precision.mixed import LOW_PRECISION


class StateFitter:
    """Loads weights whose shapes match the model's exactly."""

    def load_model_state(
        self,
        module: nn.Module,
        weights: Mapping[str, Tensor],
        *,
        meta: Mapping[str, Any],
        model_config: Mapping[str, Any] | None,
        where: str,
    ) -> list[str]:
        """Load ``weights`` into ``module``; return the keys that were refitted (none here).
        ``meta`` is the checkpoint's metadata.json, ``model_config`` this run's model config
        (together they turn a mismatch into flag advice)."""
        return load_model_state(
            module, weights, ckpt_config=meta.get("model"), model_config=model_config, where=where
        )

    def load_resharded(
        self, load_dir: str | os.PathLike, tag: str, ps: ParallelState
    ) -> dict[str, Tensor]:
        """This rank's weights from a checkpoint of another tensor/pipeline layout."""
        weights, _ = load_model_state_for(
            load_dir,
            tag,
            ps.tp_rank,
            ps.tp_size,
            ps.pp_rank,
            ps.pp_size,
            padded_vocab_size=self._resharded_rows(),
            virtual_stages=ps.virtual_pipeline_size or 1,
        )
        return weights

    def _resharded_rows(self) -> int | None:
        return None

    def fit_optimizer_state(
        self,
        optimizer: Any,
        module: nn.Module,
        opt_state: dict[str, Any],
        refitted: Sequence[str],
        meta: Mapping[str, Any],
    ) -> None:
        """Fit a whole (not partitioned) optimizer state to the refitted weights, in place."""


@dataclass(frozen=True)
class VocabPadding(StateFitter):
    """A model with padded vocabulary rows (GPT): ``keys`` name the tensors whose dim 0 is the
    padded vocabulary, ``vocab_size`` is this run's tokenizer vocabulary (a checkpoint of
    another tokenizer is refused) and ``padded_size`` this run's padded rows (what a checkpoint
    of another layout is re-padded to)."""

    keys: tuple[str, ...] = ()
    vocab_size: int | None = None
    padded_size: int | None = None

    def _saved_vocab_size(self, meta: Mapping[str, Any]) -> int | None:
        return meta.get("vocab", {}).get("size", self.vocab_size)

    def load_model_state(
        self,
        module: nn.Module,
        weights: Mapping[str, Tensor],
        *,
        meta: Mapping[str, Any],
        model_config: Mapping[str, Any] | None,
        where: str,
    ) -> list[str]:
        """Load ``weights``, re-padding the vocabulary; return the re-padded keys."""
        return load_model_state(
            module,
            weights,
            vocab_keys=self.keys,
            orig_vocab_size=self._saved_vocab_size(meta),
            vocab_size=self.vocab_size,
            ckpt_config=meta.get("model"),
            model_config=model_config,
            where=where,
        )

    def _resharded_rows(self) -> int | None:
        return self.padded_size

    def fit_optimizer_state(
        self,
        optimizer: Any,
        module: nn.Module,
        opt_state: dict[str, Any],
        refitted: Sequence[str],
        meta: Mapping[str, Any],
    ) -> None:
        """Re-pad the optimizer's state of re-padded vocabulary tensors as their weights were.

        Adam's moments and the fp32 master of such a tensor have the checkpoint's padded rows;
        stepping them against the model's other row count would be wrong (fused kernels do not
        even check). Real rows are kept, padding rows start at zero. ``opt_state`` is a
        :class:`~zerotron.precision.mixed.MixedPrecisionOptimizer` state dict.
        """
        if not refitted:
            return
        orig_vocab_size = self._saved_vocab_size(meta)
        names = {id(p): n for n, p in module.named_parameters()}
        per_param = opt_state["optimizer"]["state"]
        masters = opt_state.get("fp32_from_fp16_params") or []
        flat = 0  # torch numbers state entries over all groups in order, as model_params
        for g, group in enumerate(optimizer.param_groups):
            low = 0  # position among this group's 16-bit params (fp32_from_fp16_params[g])
            for _ in group["params"]:
                param = optimizer.model_params[flat]
                is_16bit = param.dtype in LOW_PRECISION
                if names.get(id(param)) in refitted:
                    rows = param.shape[0]
                    for key, value in per_param.get(flat, {}).items():
                        if isinstance(value, Tensor) and value.dim() == param.dim():
                            per_param[flat][key] = repad_vocab(value, orig_vocab_size, rows)
                    if is_16bit and g < len(masters) and low < len(masters[g]):
                        masters[g][low] = repad_vocab(masters[g][low], orig_vocab_size, rows)
                low += is_16bit
                flat += 1

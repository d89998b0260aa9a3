"""A checkpoint held in memory as whole tensors, read the way a saved one is read.

:class:`InMemoryCheckpoint` answers what :class:`~zerotron.checkpoint.canonical.
CanonicalCheckpoint` answers (names, shapes, each parameter's weight, fp32 master and optimizer
state, the shared counters and schedule), from full single-process tensors an import has read
from another tool's files. So :func:`~zerotron.checkpoint.convert_layout.write_layout` writes
it as any target layout's ranks would save it, optimizer state included, by the same code that
converts zerotron's own checkpoints.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from zerotron.checkpoint.canonical import Layout, canonical_order, layer_index
from zerotron.checkpoint.reshard import WORD_EMBEDDING, orig_vocab_size_of
from zerotron.errors import CheckpointError

STEP = "step"


class InMemoryCheckpoint:
    """Whole tensors under the single-process GPT's names, as canonical records.

    Args:
        root, tag: where the tensors were read from (recorded as ``converted_from``).
        meta: the metadata.json of the checkpoint (model, vocabulary, tokenizer, layout).
        layout: the source's layout (recorded as ``converted_from``).
        weights: every model tensor.
        masters, moments: fp32 masters and the elementwise optimizer state (``{key: {name:
            tensor}}``) of every weight; None / empty without optimizer state.
        step: the optimizer's step count (one for all parameters).
        groups: the torch param-group settings of the decayed (False) and not-decayed (True)
            group, as zerotron's optimizer saves them.
        client, engine: the model file's client entries (iteration, consumed samples) and its
            engine entries (``global_steps``, ``opt_param_scheduler``...).
        extras: ``grad_scaler`` and ``num_skipped_steps``.
    """

    def __init__(
        self,
        *,
        root: str | os.PathLike,
        tag: str,
        meta: dict[str, Any],
        layout: Layout,
        weights: Mapping[str, Tensor],
        masters: Mapping[str, Tensor] | None = None,
        moments: Mapping[str, Mapping[str, Tensor]] | None = None,
        step: Any = None,
        groups: Mapping[bool, dict[str, Any]] | None = None,
        client: Mapping[str, Any] | None = None,
        engine: Mapping[str, Any] | None = None,
        extras: Mapping[str, Any] | None = None,
    ):
        self.root, self.tag, self.where, self.meta = Path(root), tag, str(root), meta
        self._weights, self._masters = dict(weights), dict(masters or {})
        self._moments = {k: dict(v) for k, v in (moments or {}).items()}
        self.names = canonical_order(list(self._weights))
        for what, tensors in (("fp32 master", self._masters), *self._moments.items()):
            if tensors and set(tensors) != set(self.names):
                diff = sorted(set(tensors) ^ set(self.names))
                raise CheckpointError(
                    f"the {what} tensors and the weights name different parameters: {diff[:5]}",
                    where=self.where,
                )
        self.shapes = {n: self._weights[n].shape for n in self.names}
        self.dtypes = {n: self._weights[n].dtype for n in self.names}
        self.buffers: set[str] = set()
        self.trained = list(self.names) if self._masters else []
        self.state_keys = tuple(self._moments) if self._masters else ()
        self.entry_order = (STEP, *self.state_keys) if self.state_keys else ()
        self.num_layers = len({i for i in map(layer_index, self.names) if i is not None})
        self.orig_vocab_size = orig_vocab_size_of(meta)
        rows = self.shapes[WORD_EMBEDDING][0] if WORD_EMBEDDING in self.shapes else None
        self.layout = replace(layout, padded_vocab_size=rows or layout.padded_vocab_size)
        self._step, self._groups = step, dict(groups or {})
        self._client, self._engine = dict(client or {}), dict(engine or {})
        self._extras = dict(extras or {})

    @property
    def has_optimizer(self) -> bool:
        """Whether optimizer state (masters at least) is held."""
        return bool(self.trained)

    def tensor(self, name: str, kind: str = "weight") -> Tensor:
        """A fresh copy of ``name``'s ``kind`` tensor: "weight", "master" or a state key."""
        if kind == "weight":
            source = self._weights
        elif kind == "master":
            source = self._masters
        else:
            source = self._moments.get(kind, {})
        if name not in source:
            raise CheckpointError(f"no {kind} tensor {name!r} in the checkpoint", where=self.where)
        out = source[name].clone()
        return out if kind == "weight" else out.to(torch.float32)

    def scalars(self, name: str) -> dict[str, Any]:
        """``name``'s optimizer state that is one value (the step), copied."""
        step = self._step.clone() if isinstance(self._step, Tensor) else self._step
        return {STEP: step}

    def group_settings(self, no_decay: bool) -> dict[str, Any]:
        """The param-group settings of the decayed or the not-decayed group."""
        if no_decay not in self._groups:
            raise CheckpointError("the checkpoint holds no optimizer groups", where=self.where)
        return dict(self._groups[no_decay])

    def client_state(self) -> dict[str, Any]:
        return dict(self._client)

    def engine_entry(self, key: str, default: Any = None) -> Any:
        return self._engine.get(key, default)

    def optimizer_extras(self) -> dict[str, Any]:
        return {"grad_scaler": None, "num_skipped_steps": 0, **self._extras}

    def rng_state(self, tp_rank: int, pp_rank: int) -> Any:
        """None: another tool's RNG streams do not carry over."""
        return None

    def release(self) -> None:
        """Nothing is mapped."""

    def close(self) -> None:
        """Nothing to close."""

    def __enter__(self) -> InMemoryCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

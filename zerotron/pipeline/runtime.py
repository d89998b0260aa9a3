"""The pipeline runtime: executes one stage's schedule actions on real processes.

:class:`PipelineRuntime` takes this rank's model chunks (one per virtual stage), builds the
schedule (:mod:`~zerotron.pipeline.schedules`) and, per training step, walks this
stage's action list in order:

- ``Forward(mb, c)``: chunk ``c`` runs on the activation received for ``(mb, c)``; virtual
  stage 0 reads micro-batch ``mb`` instead. The last virtual stage turns its output into the
  micro-batch's loss with ``loss_fn``. Input and output are kept for the backward.
- ``Backward(mb, c)``: autograd from the loss × ``grad_scale / num_microbatches`` (last virtual
  stage) or from the received gradient of the output; the input's gradient is kept to be sent.
- A communication action posts its ops together (``comm.batch_isend_irecv``, ledger group
  ``"pp"``), in the action's order, so peers match first-in first-out as the schedule planned,
  and waits for its receives only: its sends drain while the stage computes (on gloo a large
  send completes when the peer receives it). They are waited for in the next communication
  action, once its receives are in, and at the end of the step, so nothing is in flight across
  steps; a failed or timed-out send surfaces there. Every wait happens no earlier than the
  blocking version's, so the schedule's deadlock freedom carries over.

Chunk protocol: a chunk is called as ``chunk(hidden, batch)`` with ``hidden`` the received
activation (None on virtual stage 0) and ``batch`` this stage's copy of the micro-batch (a
mapping); it returns the activation to send on, or, on the last virtual stage, what
``loss_fn(output, batch) -> scalar`` turns into the loss
(:class:`~zerotron.models.gpt_stage.GPTStage` is such a chunk).

Data: every stage reads the step's ``num_microbatches`` micro-batches from its own
``data_iterator`` at the start of the step (token ids and masks: small). The first stage uses
tokens / position ids, the last stage labels / loss mask, every stage the attention mask if
any. A stage whose chunks need neither (a middle stage) may pass None.

Activation shapes are not fixed in advance, but learned once: in a runtime's first training
step (and, separately, its first eval step) each activation is preceded by a shape header, a
small int64 tensor ``[dtype code, ndim, dims..., 0...]`` of :data:`HEADER_LEN` elements
(:data:`HEADER_BYTES` bytes), exchanged in a first round of the same communication action
(all headers of the action, then all payloads; both rounds keep the schedule's matching, so
neither can deadlock). Both ends keep each ``(micro-batch, chunk)``'s (shape, dtype), the
sender what it announced, the receiver what it read, and later steps of that kind send no
headers (Megatron-LM sends shapes only with ``variable_seq_lengths``). Per ``(micro-batch,
chunk)`` rather than per chunk, so the only assumption is that every step repeats the first
one's shapes, which the sender checks before each send: an output that differs from what it
announced is a :class:`~zerotron.errors.DataError` naming stage, chunk, micro-batch and both
shapes, raised before anything of that action is posted. ``variable_seq_lengths=True``
(``--variable-seq-lengths``) sends headers at every step instead. Both ends decide from their
own step count, so they agree without communicating (every stage runs the same steps).
Gradients need no header: a gradient has the shape of the output it belongs to, which its
receiver produced. Ledger per steady-state step, per boundary between consecutive virtual
stages, each way: ``m`` activations of ``b·s·h·bytes`` forward, ``m`` gradients of
``b·s·h·bytes`` backward; a header-sending step adds ``m`` headers forward.

Memory: once an output has been sent, only its autograd graph is needed, not its values, so its
storage is freed (resized to 0 bytes; shape and ``grad_fn`` stay), the idea of Megatron-LM's
output deallocation, once its send has completed (when the runtime waits for it).
``torch.autograd.backward(output, grad)`` then works on the shell. This needs the chunk's last
operation not to save its own output for backward (true of a transformer layer's residual add);
outputs that are views or leaves are never freed.

Timeline: while a recorder is active (:mod:`zerotron.distributed.trace`, ``--profile-steps``),
each training step records a ``schedule`` span around its actions and one span per action
(:func:`~zerotron.pipeline.measured.begin_action`); otherwise that costs one check per action.

Results: :meth:`PipelineRuntime.train_step` returns the mean loss over the micro-batches on the
last pipeline stage and None elsewhere (no extra communication; broadcast it over the pipeline
group if every rank must log it). Gradients accumulate into ``.grad``: zero them before the
step; after it, call :func:`~zerotron.parallel.declarations.allreduce_tied_grads`
(tied embedding), reduce over data parallel, then step the optimizer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from zerotron.distributed import comm, trace
from zerotron.distributed.state import state
from zerotron.errors import ConfigError, DataError, DistributedError
from zerotron.pipeline.check import check_schedule
from zerotron.pipeline.measured import WINDOW, begin_action
from zerotron.pipeline.schedules import (
    Action,
    Backward,
    CommBatch,
    Forward,
    P2POp,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    build_schedule,
    comm_ops,
    virtual_stage,
)

HEADER_LEN = 8  # int64 elements: dtype code, ndim, up to 6 dims
HEADER_BYTES = HEADER_LEN * 8
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

Batch = Mapping[str, Any]
LossFn = Callable[[torch.Tensor, Batch], torch.Tensor]
Key = tuple[int, int]  # (micro-batch, local chunk)


def masked_mean_loss(output: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Megatron's GPT loss: per-token losses averaged over ``batch["loss_mask"]`` (if any)."""
    mask = batch.get("loss_mask")
    if mask is None:
        return output.float().mean()
    mask = mask.float()
    return (output.float() * mask).sum() / mask.sum().clamp(min=1.0)


class PipelineRuntime:
    """Runs the pipeline schedule of this rank's stage (see the module docstring).

    ``stage_modules``: this rank's model chunks, chunk 0 first (more than one only with the
    ``"interleaved"`` schedule). ``schedule_kind``: ``"gpipe"``, ``"1f1b"`` or
    ``"interleaved"``. The pipeline group is ``state().pp``. ``variable_seq_lengths``
    (Megatron's name): send every activation's shape header at every step, for micro-batches
    whose shapes change between steps; otherwise only a runtime's first training step and first
    eval step do, and later activations must keep the shapes those announced.
    """

    def __init__(
        self,
        stage_modules: Sequence[nn.Module],
        schedule_kind: str,
        num_microbatches: int,
        loss_fn: LossFn = masked_mean_loss,
        variable_seq_lengths: bool = False,
    ):
        st = state()
        self.modules = list(stage_modules)
        self.num_chunks = len(self.modules)
        if self.num_chunks == 0:
            raise ConfigError("PipelineRuntime needs at least one model chunk")
        vpp = st.virtual_pipeline_size
        if vpp is not None and vpp != self.num_chunks:
            raise ConfigError(
                f"{self.num_chunks} model chunks on this rank, but the parallel state has "
                f"virtual pipeline size {vpp}",
                where="PipelineRuntime",
                fix="build one stage module per virtual stage (as build_gpt_stages does)",
            )
        self.kind = schedule_kind
        self.num_stages = st.pp_size
        self.stage = st.pp_rank
        self.loss_fn = loss_fn
        self._peers = st.pp.ranks  # pipeline stage -> global rank
        self.freed_bytes = 0  # output storage released after sends, over the runtime's life
        self.variable_seq_lengths = variable_seq_lengths
        self.set_num_microbatches(num_microbatches)

    def set_num_microbatches(self, num_microbatches: int, shapes_change: bool = False) -> None:
        """Run ``num_microbatches`` micro-batches a step from the next step on (every stage
        must make the same change between the same two steps): the schedule is built again,
        and the next steps announce their activation shapes again. The same number again
        changes nothing, unless ``shapes_change`` (say, the micro-batch size changed)."""
        if num_microbatches == getattr(self, "num_microbatches", None) and not shapes_change:
            return
        schedule = build_schedule(self.kind, self.num_stages, num_microbatches, self.num_chunks)
        check_schedule(schedule)  # a bad schedule is an error here, not a hang at the first step
        self.num_microbatches = num_microbatches
        self.actions: list[Action] = schedule[self.stage]
        self._eval_actions = _forward_only(self.actions)
        # Activation shapes of the first step of each kind (True: training, False: eval), as
        # announced and as received; later steps of that kind send no headers (until the
        # micro-batches change: the next steps announce theirs again).
        self._shapes: dict[bool, _Shapes] = {}

    # ---- public steps ----------------------------------------------------------------------

    def train_step(
        self, data_iterator: Iterator[Batch] | None, grad_scale: float = 1.0
    ) -> torch.Tensor | None:
        """Forward and backward of ``num_microbatches`` micro-batches; gradients accumulate.

        The loss of each micro-batch is backpropagated × ``grad_scale / num_microbatches``
        (``grad_scale`` is the fp16 loss scale, 1 otherwise). Returns the unscaled mean loss
        (detached fp32 scalar) on the last stage, None on the others.
        """
        for m in self.modules:
            m.train()
        return self._run(self.actions, self._read(data_iterator), True, grad_scale)

    @torch.no_grad()
    def eval_step(self, data_iterator: Iterator[Batch] | None) -> torch.Tensor | None:
        """Forward only (the schedule's forwards and activation messages, in its order).

        Returns the mean loss on the last stage, None elsewhere; modules are left in eval mode.
        """
        for m in self.modules:
            m.eval()
        return self._run(self._eval_actions, self._read(data_iterator), False, 1.0)

    # ---- execution -------------------------------------------------------------------------

    def _run(
        self, actions: list[Action], batches: list[Batch], training: bool, grad_scale: float
    ) -> torch.Tensor | None:
        learned = None if self.variable_seq_lengths else self._shapes.get(training)
        step = _Step(batches, training, grad_scale / self.num_microbatches, learned)
        recorder = trace.active() if training else None  # None: not recording (the usual)
        window = None if recorder is None else recorder.begin(WINDOW, "compute", **self._shape())
        for action in actions:
            span = None if recorder is None else begin_action(recorder, action)
            if isinstance(action, Forward):
                self._forward(step, action)
            elif isinstance(action, Backward):
                self._backward(step, action)
            else:
                self._communicate(step, comm_ops(action))
            if span is not None:
                recorder.end(span)
        self._settle(step.in_flight)  # nothing stays in flight across steps
        if window is not None:
            recorder.end(window)
        if not self.variable_seq_lengths:
            self._shapes.setdefault(training, step.shapes)
        if step.outputs or step.inputs or step.grads_in or step.grads_out:
            left = sorted({*step.outputs, *step.inputs, *step.grads_in, *step.grads_out})
            raise DistributedError(
                f"pipeline step ended with tensors of (micro-batch, chunk) {left} still held",
                where=f"PipelineRuntime stage {self.stage}",
            )
        if not step.losses:
            return None
        return torch.stack(step.losses).mean()

    def _shape(self) -> dict[str, Any]:
        """What a recorded step's window carries: enough to rebuild the schedule."""
        return {
            "kind": self.kind,
            "stage": self.stage,
            "stages": self.num_stages,
            "microbatches": self.num_microbatches,
            "chunks": self.num_chunks,
        }

    def _vstage(self, chunk: int) -> int:
        return virtual_stage(self.stage, chunk, self.num_stages)

    def _is_last(self, chunk: int) -> bool:
        return self._vstage(chunk) == self.num_stages * self.num_chunks - 1

    def _forward(self, step: _Step, a: Forward) -> None:
        key = (a.mb, a.chunk)
        batch = step.batches[a.mb]
        hidden = None if self._vstage(a.chunk) == 0 else step.inputs[key]
        output = self.modules[a.chunk](hidden, batch)
        if self._is_last(a.chunk):
            loss = self.loss_fn(output, batch)
            step.losses.append(loss.detach().float())
            output = loss
        if step.training:
            step.outputs[key] = output
        else:
            step.inputs.pop(key, None)
            if not self._is_last(a.chunk):
                step.outputs[key] = output  # until sent

    def _backward(self, step: _Step, a: Backward) -> None:
        key = (a.mb, a.chunk)
        output = step.outputs.pop(key)
        if self._is_last(a.chunk):
            torch.autograd.backward(output * step.loss_factor)
        else:
            torch.autograd.backward(output, grad_tensors=step.grads_in.pop(key))
        if self._vstage(a.chunk) > 0:
            hidden = step.inputs.pop(key)
            grad = hidden.grad if hidden.grad is not None else torch.zeros_like(hidden)
            step.grads_out[key] = grad.contiguous()

    def _communicate(self, step: _Step, ops: Sequence[P2POp]) -> None:
        """Post the action's messages; wait for its receives (its sends drain in the background).

        Sends of the earlier action are waited for once this action's receives are in (the
        peers have moved on by then, so they are usually done), and their outputs freed: at
        most one action's sends are in flight while the stage computes. Headers, when this
        step sends them, go in a first round of the same action.
        """
        earlier, step.in_flight = step.in_flight, []
        if step.headers:
            self._exchange_headers(step, ops)
        payloads: list[tuple[str, torch.Tensor, int]] = []
        sent_outputs: list[torch.Tensor | None] = []  # per send: the output to free after it
        for op in ops:
            key, peer = (op.mb, op.chunk), self._peers[op.peer]
            if isinstance(op, SendActivation):
                out = step.outputs[key]
                self._check_shape(step, key, out)
                payloads.append(("send", out if out.is_contiguous() else out.contiguous(), peer))
                sent_outputs.append(out if step.training else None)
            elif isinstance(op, SendGrad):
                payloads.append(("send", step.grads_out.pop(key), peer))
                sent_outputs.append(None)
            elif isinstance(op, RecvActivation):
                shape, dtype = step.shapes.received[key]
                buf = torch.empty(shape, dtype=dtype)
                step.inputs[key] = buf
                payloads.append(("recv", buf, peer))
            else:  # RecvGrad: shaped like the output it belongs to
                buf = torch.empty(step.outputs[key].shape, dtype=step.outputs[key].dtype)
                step.grads_in[key] = buf
                payloads.append(("recv", buf, peer))
        sends = comm.batch_isend_irecv(payloads, wait_sends=False)
        self._settle(earlier)
        step.in_flight += zip(sends, sent_outputs, strict=True)

        for op in ops:
            key = (op.mb, op.chunk)
            if isinstance(op, RecvActivation) and step.training:
                step.inputs[key].requires_grad_(True)
            elif isinstance(op, SendActivation) and not step.training:
                del step.outputs[key]  # the send holds what it still needs

    def _exchange_headers(self, step: _Step, ops: Sequence[P2POp]) -> None:
        """First round: announce each sent activation's shape, learn each received one's."""
        headers: list[tuple[str, torch.Tensor, int]] = []
        receiving: list[tuple[Key, torch.Tensor]] = []
        for op in ops:
            key, peer = (op.mb, op.chunk), self._peers[op.peer]
            if isinstance(op, SendActivation):
                out = step.outputs[key]
                step.shapes.sent[key] = (tuple(out.shape), out.dtype)
                headers.append(("send", _header(out), peer))
            elif isinstance(op, RecvActivation):
                buf = torch.empty(HEADER_LEN, dtype=torch.int64)
                headers.append(("recv", buf, peer))
                receiving.append((key, buf))
        sends = comm.batch_isend_irecv(headers, wait_sends=False)
        step.in_flight += ((p, None) for p in sends)
        for key, buf in receiving:
            step.shapes.received[key] = _parse_header(buf, self.stage)

    def _check_shape(self, step: _Step, key: Key, out: torch.Tensor) -> None:
        """The receiver allocates what was announced: an output must still match it."""
        announced = step.shapes.sent.get(key)
        if announced == (tuple(out.shape), out.dtype):
            return
        mb, chunk = key
        was = "nothing" if announced is None else f"{list(announced[0])} {announced[1]}"
        raise DataError(
            f"the activation of micro-batch {mb}, chunk {chunk} has shape {list(out.shape)} "
            f"{out.dtype}, but the first step announced {was} to the next stage, which "
            "receives into a buffer of that shape",
            where=f"PipelineRuntime stage {self.stage} (virtual stage {self._vstage(chunk)})",
            fix="keep micro-batch shapes fixed across steps (pad to --seq-length), or pass "
            "variable_seq_lengths=True (--variable-seq-lengths) to send shapes every step",
        )

    def _settle(self, in_flight: list[tuple[comm.Pending, torch.Tensor | None]]) -> None:
        """Wait for sends; free each sent output's storage once its send is done."""
        for pending, output in in_flight:
            pending.wait()
            if output is not None:
                self.freed_bytes += _free_storage(output)
        in_flight.clear()

    def _read(self, data_iterator: Iterator[Batch] | None) -> list[Batch]:
        m = self.num_microbatches
        needs_data = any(self._vstage(c) == 0 or self._is_last(c) for c in range(self.num_chunks))
        if data_iterator is None:
            if needs_data:
                raise ConfigError(
                    f"pipeline stage {self.stage} holds the first or last virtual stage and "
                    "needs micro-batches, but got no data iterator",
                    where="PipelineRuntime.train_step",
                    fix="pass a data iterator on the first and last pipeline stages",
                )
            return [{} for _ in range(m)]
        batches = []
        for i in range(m):
            try:
                batches.append(next(data_iterator))
            except StopIteration:
                raise DataError(
                    f"the data iterator ran out after {i} of {m} micro-batches",
                    where=f"pipeline stage {self.stage}",
                    fix="give every stage an iterator with num_microbatches micro-batches a step",
                ) from None
        return batches


class _Shapes:
    """Activation (shape, dtype) per (micro-batch, local chunk): announced, and received."""

    def __init__(self) -> None:
        self.sent: dict[Key, tuple[tuple[int, ...], torch.dtype]] = {}
        self.received: dict[Key, tuple[tuple[int, ...], torch.dtype]] = {}


class _Step:
    """What one step holds between actions, keyed by (micro-batch, chunk).

    ``learned``: the shapes of an earlier step of the same kind, which this step keeps (no
    headers); None: this step sends headers and records the shapes in ``shapes``.
    """

    def __init__(
        self, batches: list[Batch], training: bool, loss_factor: float, learned: _Shapes | None
    ):
        self.headers = learned is None
        self.shapes = learned if learned is not None else _Shapes()
        self.in_flight: list[tuple[comm.Pending, torch.Tensor | None]] = []  # sends, to free
        self.batches = batches
        self.training = training
        self.loss_factor = loss_factor
        self.inputs: dict[Key, torch.Tensor] = {}  # received activations
        self.outputs: dict[Key, torch.Tensor] = {}  # outputs (or losses) awaiting backward
        self.grads_in: dict[Key, torch.Tensor] = {}  # received output gradients
        self.grads_out: dict[Key, torch.Tensor] = {}  # input gradients awaiting their send
        self.losses: list[torch.Tensor] = []


def _forward_only(actions: list[Action]) -> list[Action]:
    """The forwards and activation messages of a schedule, in its order.

    Still deadlock-free: every remaining message keeps its batch, which the peer posts at the
    same point of the plan, and no forward waits on a gradient.
    """
    out: list[Action] = []
    for a in actions:
        if isinstance(a, Forward):
            out.append(a)
        elif not isinstance(a, Backward):
            ops = tuple(o for o in comm_ops(a) if not isinstance(o, (SendGrad, RecvGrad)))
            if len(ops) == 1:
                out.append(ops[0])
            elif ops:
                out.append(CommBatch(ops))
    return out


def _header(t: torch.Tensor) -> torch.Tensor:
    if t.dtype not in _DTYPES or t.dim() > HEADER_LEN - 2:
        raise DistributedError(
            f"cannot send a pipeline activation of dtype {t.dtype} with {t.dim()} dims",
            where="PipelineRuntime",
            fix=f"send one of {', '.join(map(str, _DTYPES))} with at most {HEADER_LEN - 2} dims",
        )
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[0], h[1] = _DTYPES.index(t.dtype), t.dim()
    h[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return h


def _parse_header(h: torch.Tensor, stage: int) -> tuple[tuple[int, ...], torch.dtype]:
    code, ndim = int(h[0]), int(h[1])
    if not (0 <= code < len(_DTYPES) and 0 <= ndim <= HEADER_LEN - 2):
        raise DistributedError(
            f"malformed activation header {h.tolist()}",
            where=f"pipeline stage {stage}",
            fix="all stages must run the same PipelineRuntime schedule",
        )
    return tuple(int(d) for d in h[2 : 2 + ndim]), _DTYPES[code]


def _free_storage(t: torch.Tensor) -> int:
    """Release a sent output's values, keeping its shape and autograd graph; bytes freed."""
    if t.grad_fn is None or t._base is not None:
        return 0  # a leaf or a view: its storage may be someone else's
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    storage.resize_(0)
    return nbytes

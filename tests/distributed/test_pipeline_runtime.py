"""Pipeline runtime on gloo ranks against the single-process GPT.

Each layout (pp2 1F1B, pp2 interleaved v=2, pp4 GPipe with m=2 < p, pp4 interleaved v=2 with
m=8) trains a tiny GPT (fp32, dropout 0) for a few steps with plain AdamW on every stage's
parameters after the tied-embedding all-reduce. The test process trains the same GPT (same
seed, same micro-batches, loss averaged over micro-batches) in one process; losses, first-step
gradients (by parameter name) and final weights must agree within 1e-5 relative. The p2p
ledger of a step must equal the closed form: per boundary between consecutive virtual stages
and micro-batch, b·s·h·4 bytes each way, plus one activation header forward in the first
training (and first eval) step only. tp2 × pp2 with sequence parallelism checks the same
against the assembled TP shards (activations between stages are then [b, s/tp, h]). Changing
shapes: an error without ``variable_seq_lengths``, equal losses with it.
"""

import itertools

import pytest
import torch

from zerotron.distributed.comm import ledger
from zerotron.distributed.state import initialize_model_parallel
from zerotron.errors import ConfigError, DataError
from zerotron.models.gpt import GPT, GPTConfig
from zerotron.models.gpt_stage import (
    TIED_COPY,
    WORD_EMBEDDING,
    build_gpt_stages,
    layer_boundaries,
)
from zerotron.parallel.declarations import allreduce_tied_grads
from zerotron.parallel.tensor import allreduce_sequence_parallel_grads
from zerotron.pipeline import HEADER_BYTES, PipelineRuntime

from .spawn import run_ranks

B, S, H, VOCAB, ORIG_VOCAB = 2, 16, 64, 1024, 1000
LR = 1e-3
# The attention key bias has a mathematically zero gradient (softmax ignores a constant shift),
# so float noise of ~1e-12 is all it gets; Adam's default eps 1e-8 would blow that noise up to
# updates of ±lr whose signs no two summation orders share. eps 1e-6 keeps them negligible.
ADAM_EPS = 1e-6
ACT_BYTES = B * S * H * 4  # one fp32 activation or gradient [b, s, h]


def make_gpt(num_layers, **kw):
    torch.manual_seed(1234)
    cfg = GPTConfig(
        num_layers=num_layers,
        hidden_size=H,
        num_attention_heads=4,
        seq_length=S,
        vocab_size=VOCAB,
        orig_vocab_size=ORIG_VOCAB,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        **kw,
    )
    return GPT(cfg)  # under TP: this rank's shards of the same full weights


def microbatches(step, m, s=S):
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for _ in range(m):
        mask = (torch.rand(B, s, generator=g) > 0.2).float()
        out.append(
            {
                "tokens": torch.randint(0, ORIG_VOCAB, (B, s), generator=g),
                "labels": torch.randint(0, ORIG_VOCAB, (B, s), generator=g),
                "position_ids": torch.arange(s).repeat(B, 1),
                "loss_mask": mask,
            }
        )
    return out


def mb_loss(model, batch):
    per_token = model(batch["tokens"], batch["position_ids"], None, batch["labels"])
    mask = batch["loss_mask"]
    return (per_token * mask).sum() / mask.sum()


def reference(num_layers, m, steps):
    """Single process: losses per step, first-step grads, final weights, eval loss."""
    model = make_gpt(num_layers)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    losses, grads = [], None
    for step in range(steps):
        opt.zero_grad()
        loss = torch.stack([mb_loss(model, b) for b in microbatches(step, m)]).mean()
        loss.backward()
        losses.append(loss.item())
        if grads is None:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
    with torch.no_grad():
        evals = torch.stack([mb_loss(model, b) for b in microbatches(99, m)]).mean().item()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses, grads, weights, evals


def _named(stages):
    """(name, param) with the last stage's tied copy under the word embedding's name."""
    for stage in stages:
        for name, p in stage.named_parameters():
            yield (WORD_EMBEDDING if name == TIED_COPY else name), p


def _pipeline_rank(rank, pp, kind, v, m, num_layers, steps, tp=1):
    st = initialize_model_parallel(tp, pp, v if v > 1 else None)
    stages = build_gpt_stages(make_gpt(num_layers, sequence_parallel=tp > 1), st.pp_rank, pp, v)
    runtime = PipelineRuntime(stages, kind, m)
    opt = torch.optim.AdamW([p for s in stages for p in s.parameters()], lr=LR, eps=ADAM_EPS)
    out = {"losses": [], "grads": None, "train_ledger": None, "emb_ledger": None}
    for step in range(steps):
        opt.zero_grad()
        freed = runtime.freed_bytes
        with ledger.capture() as cap:
            loss = runtime.train_step(iter(microbatches(step, m)))
        with ledger.capture() as emb:
            allreduce_tied_grads(stages)
        for stage in stages:
            allreduce_sequence_parallel_grads(stage)
        if step == 1:
            out["second_ledger"] = cap.summary()
        if step == 0:
            out["train_ledger"] = cap.summary()
            out["emb_ledger"] = emb.summary()
            out["freed"] = runtime.freed_bytes - freed
            out["grads"] = {n: p.grad.clone() for n, p in _named(stages)}
        out["losses"].append(None if loss is None else loss.item())
        opt.step()
    with ledger.capture() as cap:
        evals = runtime.eval_step(iter(microbatches(99, m)))
    out["eval"] = None if evals is None else evals.item()
    out["eval_ledger"] = cap.summary()
    out["weights"] = {n: p.detach().clone() for n, p in _named(stages)}
    out["layers"] = [list(s.layer_range) for s in stages]
    out["split_dim"] = {n: _split_dim(p) for n, p in _named(stages)}
    return out


def _split_dim(p):
    return p.partition_dim if getattr(p, "tensor_model_parallel", False) else None


def _close(a, b, what, tol=1e-5):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    err = (a - b).norm() / b.norm().clamp(min=1e-30)
    assert err <= tol, f"{what}: relative error {err:.3g}"


def _expected_p2p(rank, pp, v, m, train=True, act_bytes=ACT_BYTES, headers=True):
    """Closed-form {(pp, send|recv): (bytes, calls)} of one step on pipeline rank ``rank``;
    ``headers``: a step that sends shape headers (a runtime's first of its kind)."""
    last = pp * v - 1
    hdr = (HEADER_BYTES, 1) if headers else (0, 0)
    send, recv = [0, 0], [0, 0]
    for chunk in range(v):
        vs = chunk * pp + rank
        if vs < last:  # activation (+ header) out; its gradient back in
            send[0] += m * (act_bytes + hdr[0])
            send[1] += m * (1 + hdr[1])
            if train:
                recv[0] += m * act_bytes
                recv[1] += m
        if vs > 0:  # activation (+ header) in; input gradient out
            recv[0] += m * (act_bytes + hdr[0])
            recv[1] += m * (1 + hdr[1])
            if train:
                send[0] += m * act_bytes
                send[1] += m
    both = {("pp", "recv"): tuple(recv), ("pp", "send"): tuple(send)}
    return {k: v for k, v in both.items() if v[1]}  # the ledger lists only ops that happened


LAYOUTS = {
    "pp2-1f1b": (2, "1f1b", 1, 4, 4, 3),
    "pp2-interleaved-v2": (2, "interleaved", 2, 4, 4, 3),
    # p=4 with fewer micro-batches than stages (m=2): runs, and equals one process (issue 15).
    "pp4-gpipe-m2": (4, "gpipe", 1, 2, 4, 3),
    # p=4, m=8, v=2 (needs p·v = 8 layers): the deadlock-freedom run, one step.
    "pp4-interleaved-v2-m8": (4, "interleaved", 2, 8, 8, 1),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pipeline_matches_single_process(layout):
    pp, kind, v, m, num_layers, steps = LAYOUTS[layout]
    results = run_ranks(_pipeline_rank, pp, pp, kind, v, m, num_layers, steps, timeout=90)
    ref_losses, ref_grads, ref_weights, ref_eval = reference(num_layers, m, steps)

    # Loss on the last stage only; every layer on exactly one (rank, chunk).
    *others, last = results
    assert all(r["losses"] == [None] * steps and r["eval"] is None for r in others)
    _close(last["losses"], ref_losses, "losses")
    _close(last["eval"], ref_eval, "eval loss")
    held = sorted(i for r in results for chunk in r["layers"] for i in chunk)
    assert held == list(range(num_layers))

    # Gradients (step 0) and final weights, by name; the tied weight lives on two ranks.
    for key, ref in (("grads", ref_grads), ("weights", ref_weights)):
        seen = {}
        for rank, r in enumerate(results):
            for name, t in r[key].items():
                _close(t, ref[name], f"{key} {name} on rank {rank}")
                seen.setdefault(name, []).append(rank)
        assert set(seen) == set(ref)
        assert seen[WORD_EMBEDDING] == [0, pp - 1]
        assert all(len(ranks) == 1 for n, ranks in seen.items() if n != WORD_EMBEDDING)

    # Ledger: p2p per step in closed form; embedding all-reduce once on first and last stage.
    for rank, r in enumerate(results):
        assert r["train_ledger"] == _expected_p2p(rank, pp, v, m), f"rank {rank}"
        if steps > 1:  # shapes were exchanged once: the second step sends no headers
            second = _expected_p2p(rank, pp, v, m, headers=False)
            assert r["second_ledger"] == second, f"rank {rank}"
        assert r["eval_ledger"] == _expected_p2p(rank, pp, v, m, train=False), f"rank {rank}"
        emb = {("embedding", "all_reduce"): (VOCAB * H * 4, 1)} if rank in (0, pp - 1) else {}
        assert r["emb_ledger"] == emb, f"rank {rank}"
        # Every activation sent was freed after its send (sent outputs are never views here).
        assert r["freed"] == sum(m * ACT_BYTES for c in range(v) if c * pp + rank < pp * v - 1)
    total_send = sum(r["train_ledger"][("pp", "send")][0] for r in results)
    assert total_send == m * (pp * v - 1) * (2 * ACT_BYTES + HEADER_BYTES)


def test_tensor_and_pipeline_parallel_match_single_process():
    """tp2 × pp2 (1F1B) with sequence parallelism: stages pass [b, s/tp, h] activations."""
    tp, pp, m, steps = 2, 2, 4, 2
    results = run_ranks(_pipeline_rank, tp * pp, pp, "1f1b", 1, m, 4, steps, tp, timeout=90)
    ref_losses, ref_grads, ref_weights, ref_eval = reference(4, m, steps)
    by_stage = [results[s * tp : (s + 1) * tp] for s in range(pp)]  # rank = pp_rank * tp + tp
    for r in by_stage[-1]:
        _close(r["losses"], ref_losses, "losses")
        _close(r["eval"], ref_eval, "eval loss")
    assert all(r["losses"] == [None] * steps for r in by_stage[0])
    # Final weights: 1e-5 over the whole model, 1e-3 per tensor. TP sums in another order, so a
    # gradient element 1e-5 the size of its neighbours (one in layers.0.mlp.dense_4h_to_h.bias)
    # carries ~1% of fp32 rounding; Adam normalizes it into a full-size update, which moves
    # that zero-initialized bias by ~1e-4 of its norm. The gradients themselves agree to 1e-5.
    for key, ref, tol in (("grads", ref_grads, 1e-5), ("weights", ref_weights, 1e-3)):
        full = {}
        for stage, shards in enumerate(by_stage):
            for name, dim in shards[0]["split_dim"].items():
                parts = [r[key][name] for r in shards]
                if dim is None:
                    _close(parts[1], parts[0], f"{key} {name}: TP replicas")
                full[name] = parts[0] if dim is None else torch.cat(parts, dim=dim)
                _close(full[name], ref[name], f"{key} {name} on stage {stage}", tol)
        assert set(full) == set(ref)
        flat = [torch.cat([t[n].flatten() for n in sorted(ref)]) for t in (full, ref)]
        _close(*flat, f"all {key}")
    sp_act = B * (S // tp) * H * 4  # the sequence shard of one activation
    for rank, r in enumerate(results):
        pp_rank = rank // tp
        p2p = {k: v for k, v in r["train_ledger"].items() if k[0] == "pp"}
        assert p2p == _expected_p2p(pp_rank, pp, 1, m, act_bytes=sp_act), f"rank {rank}"
        p2p = {k: v for k, v in r["second_ledger"].items() if k[0] == "pp"}
        assert p2p == _expected_p2p(pp_rank, pp, 1, m, act_bytes=sp_act, headers=False)
        assert r["emb_ledger"] == {("embedding", "all_reduce"): (VOCAB // tp * H * 4, 1)}


def _shapes_rank(rank, m):
    """pp2 1F1B: fixed shapes (train S twice, eval S/2 twice, then a train step at S/2), then
    ``variable_seq_lengths`` (train at S, then S/2); losses and p2p ledgers per call."""
    initialize_model_parallel(1, 2)
    stages = build_gpt_stages(make_gpt(2), rank, 2)
    out = {"losses": [], "ledgers": []}

    def call(step_fn, step, s):
        with ledger.capture() as cap:
            loss = step_fn(iter(microbatches(step, m, s)))
        out["losses"].append(None if loss is None else loss.item())
        out["ledgers"].append(cap.summary())

    fixed = PipelineRuntime(stages, "1f1b", m)
    for fn, step, s in CALLS[:4]:
        call(getattr(fixed, fn), step, s)
    out["error"] = None
    if rank == 0:  # the sender finds out before posting anything; rank 1 sits this one out
        try:
            fixed.train_step(iter(microbatches(4, m, S // 2)))
        except DataError as err:
            out["error"] = str(err)
    variable = PipelineRuntime(stages, "1f1b", m, variable_seq_lengths=True)
    for fn, step, s in CALLS[4:]:
        call(getattr(variable, fn), step, s)
    # set_num_microbatches (the engine's set_train_batch_size): m, then 2m, a step each
    out["resized"] = {"losses": [], "ledgers": []}
    resized = PipelineRuntime(stages, "1f1b", m)
    for step, count, s in RESIZED:
        resized.set_num_microbatches(count, shapes_change=s != S)
        with ledger.capture() as cap:
            loss = resized.train_step(iter(microbatches(step, count, s)))
        out["resized"]["losses"].append(None if loss is None else loss.item())
        out["resized"]["ledgers"].append(cap.summary())
    return out


# (data seed, micro-batches, sequence length) of each step of a resized runtime: the last one
# changes its micro-batches' shape and says so
RESIZED = [(7, 2, S), (8, 4, S), (9, 4, S), (10, 4, S // 2)]


# (method, data seed, sequence length) of each call; the first four on a fixed-shape runtime
CALLS = [
    ("train_step", 0, S),
    ("train_step", 1, S),
    ("eval_step", 2, S // 2),
    ("eval_step", 3, S // 2),
    ("train_step", 5, S),
    ("train_step", 6, S // 2),
]
HEADERS = [True, False, True, False, True, True]  # which calls send shape headers


def test_shapes_are_sent_once_unless_variable_seq_lengths():
    m = 2
    results = run_ranks(_shapes_rank, 2, m, timeout=90)
    model = make_gpt(2)
    with torch.no_grad():  # no optimizer step between calls: the same weights throughout
        ref = [
            torch.stack([mb_loss(model, b) for b in microbatches(step, m, s)]).mean().item()
            for _, step, s in CALLS
        ]
    assert results[0]["losses"] == [None] * len(CALLS)
    _close(results[1]["losses"], ref, "losses")
    for rank, r in enumerate(results):
        for i, ((fn, _, s), headers) in enumerate(zip(CALLS, HEADERS, strict=True)):
            want = _expected_p2p(
                rank, 2, 1, m, fn == "train_step", act_bytes=B * s * H * 4, headers=headers
            )
            assert r["ledgers"][i] == want, f"rank {rank}, call {i}"
    err = results[0]["error"]
    assert err is not None and "micro-batch 0, chunk 0 has shape [2, 8, 64]" in err, err
    # more micro-batches a step: the new schedule runs them all, and announces shapes again
    with torch.no_grad():
        ref = [
            torch.stack([mb_loss(model, b) for b in microbatches(step, count, s)]).mean().item()
            for step, count, s in RESIZED
        ]
    assert results[0]["resized"]["losses"] == [None] * len(RESIZED)
    _close(results[1]["resized"]["losses"], ref, "resized losses")
    for rank, r in enumerate(results):
        for i, ((_, count, s), headers) in enumerate(zip(RESIZED, (True, True, False, True))):
            want = _expected_p2p(rank, 2, 1, count, True, act_bytes=B * s * H * 4, headers=headers)
            assert r["resized"]["ledgers"][i] == want, f"rank {rank}, resized step {i}"
    assert "announced [2, 16, 64] torch.float32" in err and "variable_seq_lengths=True" in err
    assert "stage 0" in err


# ---- one process: the runtime without communication, partitioning, errors -------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_planner_closed_form_is_the_ledgers(layout):
    """tuning.volume's pipeline terms (what comm_volume and the cost model use) equal the
    closed form the runs above check against their ledgers: steady state, and a first step."""
    from zerotron.tuning.estimate import Layout, ModelShape
    from zerotron.tuning.volume import shape_header_terms, step_terms

    pp, _, v, m, num_layers, _ = LAYOUTS[layout]
    shape = ModelShape(num_layers, H, 4, S, ORIG_VOCAB)
    lay = Layout(pp=pp, vpp=v, micro_batch_size=B, num_microbatches=m, precision="fp32")
    for rank in range(pp):
        steady = step_terms(shape, lay, rank)
        for terms, headers in ((steady, False), (steady + shape_header_terms(lay, rank), True)):
            got = {}
            for t in terms:
                if t.group == "pp":
                    nbytes, calls = got.get((t.group, t.op), (0, 0))
                    got[t.group, t.op] = (nbytes + t.nbytes, calls + t.calls)
            assert got == _expected_p2p(rank, pp, v, m, headers=headers), (rank, headers)


def test_single_stage_runtime_matches_model():
    m = 3
    stages = build_gpt_stages(make_gpt(2), 0, 1)
    assert stages[0].pre_process and stages[0].post_process
    runtime = PipelineRuntime(stages, "1f1b", m)
    loss = runtime.train_step(iter(microbatches(0, m)), grad_scale=4.0)
    model = make_gpt(2)
    ref = torch.stack([mb_loss(model, b) for b in microbatches(0, m)]).mean()
    (ref * 4.0).backward()
    _close(loss, ref.item(), "loss")
    grads = dict(_named(stages))
    assert set(grads) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        _close(grads[name].grad, p.grad, name)


def test_partition_by_parameters_minimizes_heaviest_stage():
    model = make_gpt(6)
    pp = 3

    uniform = [
        sum(p.numel() for p in build_gpt_stages(model, s, pp)[0].parameters()) for s in range(pp)
    ]
    layer = sum(p.numel() for p in model.layers[0].parameters())
    emb = sum(p.numel() for p in model.embedding.parameters())
    head = sum(p.numel() for p in model.final_layernorm.parameters()) + VOCAB * H
    # Brute force over every split of 6 layers into 3 non-empty stages.
    best = min(
        max(emb + a * layer, (b - a) * layer, (6 - b) * layer + head)
        for a, b in itertools.combinations(range(1, 6), 2)
    )
    bounds = layer_boundaries(model, pp, method="parameters")
    counts = []
    for s in range(pp):
        chunk = build_gpt_stages(model, s, pp, partition_method="parameters")[0]
        assert list(chunk.layer_range) == list(range(bounds[s], bounds[s + 1]))
        counts.append(sum(p.numel() for p in chunk.parameters()))
    assert max(counts) == best < max(uniform)


def test_errors():
    stages = build_gpt_stages(make_gpt(2), 0, 1)
    runtime = PipelineRuntime(stages, "gpipe", 3)
    with pytest.raises(DataError, match="ran out after 2 of 3"):
        runtime.train_step(iter(microbatches(0, 2)))
    with pytest.raises(ConfigError, match="no data iterator"):
        runtime.train_step(None)
    with pytest.raises(ConfigError, match="unknown pipeline partition"):
        build_gpt_stages(make_gpt(2), 0, 1, partition_method="flops")
    with pytest.raises(ConfigError, match="no virtual stages"):
        PipelineRuntime(stages * 2, "1f1b", 4)

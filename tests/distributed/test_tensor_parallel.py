"""Tensor and sequence parallelism on 2 gloo ranks against one process.

One ``run_ranks`` call does all the distributed work (spawning dominates the cost); the tests
check its results against references computed here, in the test process, with plain torch and
the single-process model:

- the mappings: forward outputs and input gradients, exactly (integer-valued floats);
- the layers with ``gather_output`` / ``input_is_parallel=False``: equal to ``F.linear``;
- vocab-parallel cross entropy: equal to ``F.cross_entropy`` over the real vocabulary, with
  padded columns (a whole rank of them, too) excluded and getting zero gradient;
- GPT at TP=2, and TP=2 with sequence parallelism: the shards assembled equal the TP=1 model
  for the same seed; per-token loss and every gradient equal the TP=1 model's (1e-5 relative),
  although the vocabulary is padded differently (1008 rows at TP=1, 1056 at TP=2);
- the comm ledger of one forward + backward equals the closed form (see ``expected_*``);
- dropout: the default stream stays identical across TP ranks, the model-parallel stream is
  used and differs; full recompute replays both (same gradients as without recompute).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from zerotron.data.tokenizer import vocab_size_with_padding
from zerotron.distributed import get_rng_tracker, ledger, model_parallel_seed
from zerotron.distributed.state import initialize_model_parallel, state
from zerotron.models.gpt import GPT, GPTConfig, KVCache
from zerotron.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    allreduce_sequence_parallel_grads,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
    vocab_parallel_cross_entropy,
)

from .spawn import run_ranks

TP = 2
ORIG_VOCAB = 1000
DIVISIBLE_BY = 48  # TP=1: 1008 rows, TP=2: 1056 (rank 1 holds ids 528..1055, 1000.. padding)
B, S, H, LAYERS, HEADS = 2, 16, 64, 2, 4
SEED = 1234


def model_config(tp: int, **kw) -> GPTConfig:
    base = dict(
        num_layers=LAYERS,
        hidden_size=H,
        num_attention_heads=HEADS,
        seq_length=S,
        vocab_size=vocab_size_with_padding(ORIG_VOCAB, DIVISIBLE_BY, tp, log=False),
        orig_vocab_size=ORIG_VOCAB,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return GPTConfig(**{**base, **kw})


def batch():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, ORIG_VOCAB, (B, S), generator=g)
    labels = torch.randint(0, ORIG_VOCAB, (B, S), generator=g)
    weights = torch.rand(B, S, generator=g)  # a loss mask with arbitrary weights
    return tokens, labels, weights


def ints(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-20, 20, shape, generator=g).float()


# ------------------------------------------------------------------------------------------
# What each rank runs


def _mapping(fn, x, grad):
    x = x.clone().requires_grad_()
    y = fn(x)
    y.backward(grad)
    return y.detach(), x.grad


def _mappings(rank):
    x = ints((2, 4, 6), 100 + rank)  # [b, s, h]: s and h split evenly over 2 ranks
    half_h, half_s = ints((2, 4, 3), 200 + rank), ints((2, 2, 6), 300 + rank)
    full = ints((2, 4, 6), 400 + rank)
    cases = {
        "copy": (copy_to_tensor_model_parallel_region, x, full),
        "reduce": (reduce_from_tensor_model_parallel_region, x, full),
        "scatter": (scatter_to_tensor_model_parallel_region, x, half_h),
        "gather": (gather_from_tensor_model_parallel_region, half_h, full),
        "sp_scatter": (scatter_to_sequence_parallel_region, x, half_s),
        "sp_gather": (gather_from_sequence_parallel_region, half_s, full),
        "sp_gather_replicated": (
            lambda t: gather_from_sequence_parallel_region(t, tensor_parallel_output_grad=False),
            half_s,
            full,
        ),
        "sp_reduce_scatter": (reduce_scatter_to_sequence_parallel_region, x, half_s),
    }
    out = {}
    for name, (fn, inp, grad) in cases.items():
        with ledger.capture() as cap:
            out[name] = (*_mapping(fn, inp, grad), cap.entries)
    return out


def _layers(rank):
    """Column with gather_output and Row with a full input, against the full weight."""
    torch.manual_seed(5)
    col = ColumnParallelLinear(6, 8, gather_output=True)
    row = RowParallelLinear(8, 6, input_is_parallel=False)
    with torch.no_grad():
        row.bias.copy_(torch.arange(6.0))
    x = ints((3, 6), 9).requires_grad_()
    y = row(col(x))
    y.backward(ints((3, 6), 10))
    return {
        "y": y.detach(),
        "x_grad": x.grad,
        "col_w": col.weight.detach(),
        "col_b": col.bias.detach(),
        "row_w": row.weight.detach(),
        "grads": (col.weight.grad, col.bias.grad, row.weight.grad, row.bias.grad),
    }


def ce_case():
    """Logits over 64 padded ids of which 30 are real: rank 1's half is all padding."""
    g = torch.Generator().manual_seed(3)
    logits = 4 * torch.randn(3, 5, 64, generator=g)
    logits[..., 30:] = float("-inf")
    target = torch.randint(0, 30, (3, 5), generator=g)
    weights = torch.rand(3, 5, generator=g)
    # and one case with real ids on both ranks
    logits2 = 4 * torch.randn(3, 5, 64, generator=g)
    logits2[..., 50:] = float("-inf")
    target2 = torch.randint(0, 50, (3, 5), generator=g)
    return (logits, target, weights), (logits2, target2, weights)


def _cross_entropy(rank):
    out = []
    for logits, target, weights in ce_case():
        mine = logits.chunk(TP, dim=-1)[rank].clone().requires_grad_()
        with ledger.capture() as cap:
            loss = vocab_parallel_cross_entropy(mine * 1.0, target)
            (loss * weights).sum().backward()
        out.append((loss.detach(), mine.grad, cap.entries))
    return out


def _shard(model: GPT, ref_sd: dict[str, torch.Tensor], junk_rows: float) -> None:
    """Load the TP=1 state dict into this rank's shards (vocab re-padded with junk rows)."""
    rank = state().tp_rank
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = ref_sd[name]
            if name == "embedding.word_embeddings.weight":
                rows = p.shape[0] * TP
                pad = torch.full((rows - ORIG_VOCAB, H), junk_rows)
                full = torch.cat([full[:ORIG_VOCAB], pad])  # padding must not matter
            if getattr(p, "tensor_model_parallel", False):
                full = full.chunk(TP, dim=p.partition_dim)[rank]
            p.copy_(full)


def _train_step(model: GPT):
    tokens, labels, weights = batch()
    positions = torch.arange(S).expand(B, S)  # as pretraining passes them (SP slices them)
    with ledger.capture() as cap:
        loss = model(tokens, positions, labels=labels)
        (loss * weights).sum().backward()
        allreduce_sequence_parallel_grads(model)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, cap.entries


def _gpt(rank, ref_sd):
    out = {}
    for sp in (False, True):
        torch.manual_seed(SEED)
        model = GPT(model_config(TP, sequence_parallel=sp))
        out[sp, "init"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[sp, "sp_marked"] = sorted(
            n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)
        )
        _shard(model, ref_sd, junk_rows=3.0)
        twin = copy.deepcopy(model)  # e.g. a pipeline stage cut from it: shares the TP group
        out[sp, "step"] = _train_step(model)
        out[sp, "twin_loss"] = _train_step(twin)[0]
        model.zero_grad(set_to_none=True)
        model.eval()
        with torch.no_grad():
            out[sp, "logits"] = model(batch()[0])
            if not sp:  # incremental decoding: this rank's heads in the cache
                cache = KVCache.for_model(model, B)
                first = model(batch()[0][:, :10], kv_cache=cache)
                out["cached_logits"] = torch.cat(
                    [first, model(batch()[0][:, 10:], kv_cache=cache)], 1
                )
    return out


def _dropout(rank, ref_sd):
    """Dropout on: which streams each model draws from; recompute replays them."""
    out = {}
    for sp in (False, True):
        grads = []
        for recompute in (None, "full"):
            cfg = model_config(
                TP,
                sequence_parallel=sp,
                hidden_dropout=0.2,
                attention_dropout=0.2,
                recompute_granularity=recompute,
            )
            model = GPT(cfg)
            _shard(model, ref_sd, junk_rows=0.0)
            model_parallel_seed(SEED)
            tracker_before = get_rng_tracker().get_states()
            loss, g, _ = _train_step(model)
            grads.append(g)
            if recompute is None:
                out[sp, "default_state"] = torch.get_rng_state()
                out[sp, "tracker_before"] = tracker_before
                out[sp, "tracker_after"] = get_rng_tracker().get_states()
                out[sp, "loss"] = loss
        out[sp, "recompute_equal"] = all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    return out


def _rank(rank, ref_sd):
    initialize_model_parallel(TP)
    assert state().tp.size == TP
    return {
        "mappings": _mappings(rank),
        "layers": _layers(rank),
        "ce": _cross_entropy(rank),
        "gpt": _gpt(rank, ref_sd),
        "dropout": _dropout(rank, ref_sd),
    }


# ------------------------------------------------------------------------------------------
# References, in this process (TP=1)


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(SEED)
    model = GPT(model_config(1))
    sd = {n: p.detach().clone() for n, p in model.named_parameters()}
    tokens, labels, weights = batch()
    loss = model(tokens, labels=labels)
    (loss * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.eval()
    with torch.no_grad():
        logits = model(tokens)
    return {"sd": sd, "loss": loss.detach(), "grads": grads, "logits": logits}


TP_RUN = pytest.mark.xdist_group("tensor_parallel")  # one spawn for the tests that read it


@pytest.fixture(scope="module")
def results(reference):
    return run_ranks(_rank, TP, reference["sd"], timeout=120)


def assemble(name: str, shards: list[torch.Tensor], like: torch.nn.Module) -> torch.Tensor:
    p = dict(like.named_parameters())[name]
    if getattr(p, "tensor_model_parallel", False):
        return torch.cat(shards, dim=p.partition_dim)
    assert torch.equal(shards[0], shards[1]), f"{name} differs across TP ranks"
    return shards[0]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


# ------------------------------------------------------------------------------------------
# Tests


@TP_RUN
def test_mappings_forward_and_backward_exact(results):
    xs = [ints((2, 4, 6), 100 + r) for r in range(TP)]
    half_h = [ints((2, 4, 3), 200 + r) for r in range(TP)]
    half_s = [ints((2, 2, 6), 300 + r) for r in range(TP)]
    fulls = [ints((2, 4, 6), 400 + r) for r in range(TP)]
    sum_x, sum_full = sum(xs), sum(fulls)
    nbytes = {"full": 2 * 4 * 6 * 4, "half": 2 * 4 * 3 * 4}
    for r in range(TP):
        want = {  # (forward output, input gradient, ledger)
            "copy": (xs[r], sum_full, [("tp", "all_reduce", nbytes["full"])]),
            "reduce": (sum_x, fulls[r], [("tp", "all_reduce", nbytes["full"])]),
            "scatter": (
                xs[r].chunk(TP, -1)[r],
                torch.cat(half_h, -1),
                [("tp", "all_gather", nbytes["half"])],
            ),
            "gather": (
                torch.cat(half_h, -1),
                fulls[r].chunk(TP, -1)[r],
                [("tp", "all_gather", nbytes["half"])],
            ),
            "sp_scatter": (
                xs[r].chunk(TP, 1)[r],
                torch.cat(half_s, 1),
                [("tp", "all_gather", nbytes["half"])],
            ),
            "sp_gather": (
                torch.cat(half_s, 1),
                sum_full.chunk(TP, 1)[r],
                [("tp", "all_gather", nbytes["half"]), ("tp", "reduce_scatter", nbytes["full"])],
            ),
            "sp_gather_replicated": (
                torch.cat(half_s, 1),
                fulls[r].chunk(TP, 1)[r],
                [("tp", "all_gather", nbytes["half"])],
            ),
            "sp_reduce_scatter": (
                sum_x.chunk(TP, 1)[r],
                torch.cat(half_s, 1),
                [("tp", "reduce_scatter", nbytes["full"]), ("tp", "all_gather", nbytes["half"])],
            ),
        }
        for name, (y, grad, entries) in want.items():
            got_y, got_grad, got_entries = results[r]["mappings"][name]
            assert torch.equal(got_y, y), (r, name)
            assert torch.equal(got_grad, grad), (r, name)
            assert got_entries == entries, (r, name)


def test_mappings_are_free_at_tp1():
    x = torch.ones(2, 4, 6, requires_grad=True)
    with ledger.capture() as cap:
        for fn in (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
            scatter_to_tensor_model_parallel_region,
            gather_from_tensor_model_parallel_region,
            scatter_to_sequence_parallel_region,
            gather_from_sequence_parallel_region,
            reduce_scatter_to_sequence_parallel_region,
        ):
            assert fn(x) is x
    assert cap.entries == []


@TP_RUN
def test_column_gather_output_and_row_with_full_input(results):
    torch.manual_seed(5)
    col = ColumnParallelLinear(6, 8, gather_output=True)
    row = RowParallelLinear(8, 6, input_is_parallel=False)
    with torch.no_grad():
        row.bias.copy_(torch.arange(6.0))
    x = ints((3, 6), 9).requires_grad_()
    y = row(col(x))
    y.backward(ints((3, 6), 10))
    got = [results[r]["layers"] for r in range(TP)]
    # TP-independent init: the shards are the halves of the TP=1 weights, exactly
    assert torch.equal(torch.cat([g["col_w"] for g in got]), col.weight)
    assert torch.equal(torch.cat([g["row_w"] for g in got], 1), row.weight)
    for r in range(TP):
        torch.testing.assert_close(got[r]["y"], y, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(got[r]["x_grad"], x.grad, rtol=1e-6, atol=1e-5)
    cw, cb, rw, rb = zip(*(g["grads"] for g in got), strict=True)
    torch.testing.assert_close(torch.cat(cw), col.weight.grad, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(torch.cat(cb), col.bias.grad, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(torch.cat(rw, 1), row.weight.grad, rtol=1e-6, atol=1e-5)
    assert torch.equal(rb[0], rb[1])
    torch.testing.assert_close(rb[0], row.bias.grad)


@TP_RUN
def test_vocab_parallel_cross_entropy_matches_torch_without_padding(results):
    for case, (logits, target, weights) in enumerate(ce_case()):
        real = int(torch.isfinite(logits[0, 0]).sum())
        full = logits.clone().requires_grad_()
        ref = F.cross_entropy(
            full[..., :real].reshape(-1, real), target.reshape(-1), reduction="none"
        )
        (ref.view(3, 5) * weights).sum().backward()
        for r in range(TP):
            loss, grad, entries = results[r]["ce"][case]
            torch.testing.assert_close(loss, ref.view(3, 5), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(grad, full.grad.chunk(TP, -1)[r], rtol=1e-6, atol=1e-7)
            # max, predicted logit, sum of exponentials: [tokens] fp32 each
            assert entries == [("tp", "all_reduce", 3 * 5 * 4)] * 3
        assert torch.equal(full.grad[..., real:], torch.zeros_like(full.grad[..., real:]))


@TP_RUN
def test_gpt_init_is_independent_of_tp(results):
    for sp in (False, True):
        torch.manual_seed(SEED)
        ref = GPT(model_config(TP))  # same padding (1056 rows), one process
        for name, p in ref.named_parameters():
            got = assemble(name, [results[r]["gpt"][sp, "init"][name] for r in range(TP)], ref)
            assert torch.equal(got, p), (sp, name)


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
@TP_RUN
def test_gpt_loss_and_grads_match_one_process(results, reference, sp):
    ref = GPT(model_config(1))  # parameter attributes only
    for r in range(TP):
        loss, _, _ = results[r]["gpt"][sp, "step"]
        torch.testing.assert_close(loss, reference["loss"], rtol=1e-5, atol=0)
        assert torch.equal(results[r]["gpt"][sp, "twin_loss"], loss)
    for name, want in reference["grads"].items():
        got = assemble(name, [results[r]["gpt"][sp, "step"][1][name] for r in range(TP)], ref)
        if name == "embedding.word_embeddings.weight":
            # padded rows (1008 at TP=1, 1056 at TP=2): no gradient anywhere
            assert torch.equal(got[ORIG_VOCAB:], torch.zeros_like(got[ORIG_VOCAB:]))
            got, want = got[:ORIG_VOCAB], want[:ORIG_VOCAB]
        assert got.shape == want.shape
        assert rel_err(got, want) < 1e-5, (name, rel_err(got, want))


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
@TP_RUN
def test_gpt_logits_exclude_padding(results, reference, sp):
    want = reference["logits"]  # [b, s, 1008], -inf from 1000 on
    for r in range(TP):
        got = results[r]["gpt"][sp, "logits"]
        assert got.shape == (B, S, 1056)
        assert torch.all(got[..., ORIG_VOCAB:] == float("-inf"))
        torch.testing.assert_close(
            got[..., :ORIG_VOCAB], want[..., :ORIG_VOCAB], rtol=1e-5, atol=1e-5
        )
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        if not sp:
            cached = results[r]["gpt"]["cached_logits"]
            torch.testing.assert_close(cached, got, rtol=1e-5, atol=1e-5)


@TP_RUN
def test_sequence_parallel_marks_the_replicated_params(results):
    ln = [
        f"layers.{i}.{m}.{p}"
        for i in range(LAYERS)
        for m in ("input_layernorm", "post_attention_layernorm")
        for p in ("weight", "bias")
    ]
    bias = [
        f"layers.{i}.{m}.bias"
        for i in range(LAYERS)
        for m in ("self_attention.dense", "mlp.dense_4h_to_h")
    ]
    want = sorted(
        ln
        + bias
        + ["final_layernorm.weight", "final_layernorm.bias", "embedding.position_embeddings.weight"]
    )
    for r in range(TP):
        assert results[r]["gpt"][True, "sp_marked"] == want
        assert results[r]["gpt"][False, "sp_marked"] == []


def expected_tp_ledger() -> dict:
    """Forward + backward of one micro-batch at TP=2, fp32 (4 bytes), no SP.

    Per layer: 2 all-reduces in forward (after attention ``dense`` and ``dense_4h_to_h``),
    2 in backward (the input gradients of ``query_key_value`` and ``dense_h_to_4h``), each of
    b·s·h. Outside the layers: the word embedding's forward all-reduce and the output layer's
    backward all-reduce (b·s·h each), and the cross entropy's 3 all-reduces of b·s scalars.
    """
    bsh, bs = B * S * H * 4, B * S * 4
    count = 4 * LAYERS + 2 + 3
    return {("tp", "all_reduce"): ((4 * LAYERS + 2) * bsh + 3 * bs, count)}


def expected_sp_ledger() -> dict:
    """The same with sequence parallelism: every all-reduce of b·s·h becomes an all-gather of
    this rank's b·(s/tp)·h shard and a reduce-scatter of b·s·h (4 of each per layer, 1 each for
    the embedding and the output layer). All-reduces left: the cross entropy's 3 of b·s, and one
    of the sequence-parallel gradients: per layer 2 LayerNorms (2h each) and 2 row-parallel
    biases (h each), the final LayerNorm (2h) and the position embeddings (P·h)."""
    bsh, bs = B * S * H * 4, B * S * 4
    n = 4 * LAYERS + 2
    sp_grads = 4 * (LAYERS * (2 * 2 * H + 2 * H) + 2 * H + S * H)
    return {
        ("tp", "all_gather"): (n * bsh // TP, n),
        ("tp", "all_reduce"): (3 * bs + sp_grads, 4),
        ("tp", "reduce_scatter"): (n * bsh, n),
    }


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
@TP_RUN
def test_comm_ledger_matches_the_closed_form(results, sp):
    want = expected_sp_ledger() if sp else expected_tp_ledger()
    for r in range(TP):
        entries = results[r]["gpt"][sp, "step"][2]
        got: dict = {}
        for group, op, nbytes in entries:
            total, count = got.get((group, op), (0, 0))
            got[group, op] = (total + nbytes, count + 1)
        assert got == want


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2_sp"])
@TP_RUN
def test_dropout_streams_under_tp(results, sp):
    d = [results[r]["dropout"] for r in range(TP)]
    # the default stream (residual dropout without SP) stays in step across TP ranks
    assert torch.equal(d[0][sp, "default_state"], d[1][sp, "default_state"])
    # the model-parallel stream was drawn from, and it differs across TP ranks
    for r in range(TP):
        before = d[r][sp, "tracker_before"]["model-parallel-rng"]["cpu"]
        after = d[r][sp, "tracker_after"]["model-parallel-rng"]["cpu"]
        assert not torch.equal(before, after)
    assert not torch.equal(
        d[0][sp, "tracker_after"]["model-parallel-rng"]["cpu"],
        d[1][sp, "tracker_after"]["model-parallel-rng"]["cpu"],
    )
    # the loss is the same tensor on both ranks (TP ranks are one model)
    assert torch.equal(d[0][sp, "loss"], d[1][sp, "loss"])
    # full recompute replays the tracker's stream as well as the default one
    assert d[0][sp, "recompute_equal"] and d[1][sp, "recompute_equal"]

"""Fused output layer + cross entropy against the unfused path (F.linear, then the loss)."""

import pytest
import torch
import torch.nn.functional as F

from zerotron.kernels import fused_cross_entropy as fce
from zerotron.kernels import fused_linear_cross_entropy, policy, upcast
from zerotron.kernels.fused_cross_entropy import ChunkWorkspace, default_chunk_size
from zerotron.kernels.policy import KernelChoices
from zerotron.models import GPT, GPTConfig

H, V, V_PAD = 24, 50, 64


def inputs(dtype, tokens=(3, 13), seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(*tokens, H, generator=g)).to(dtype).requires_grad_()
    w = torch.randn(V_PAD, H, generator=g)
    w[V:] = 0.0  # padding rows, as the model initializes them
    w = w.to(dtype).requires_grad_()
    target = torch.randint(0, V, tokens, generator=g)
    return x, w, target


def unfused(x, w, target, linear=F.linear):
    logits = linear(x, w[:V], None).float()
    loss = F.cross_entropy(logits.reshape(-1, V), target.reshape(-1), reduction="none")
    return loss.view(target.shape)


def assert_close(ours, ref, rtol=1e-6, what=""):
    """Within ``rtol`` of the reference's largest magnitude (sums cancel: no per-element rtol)."""
    assert ours.shape == ref.shape and ours.dtype == ref.dtype, what
    err = (ours.double() - ref.double()).abs().max() / ref.double().abs().max()
    assert err <= rtol, f"{what}: max error {err.item():.2e} of the largest entry > {rtol:.0e}"


def loss_and_grads(fn, x, w, target, upstream):
    x.grad = w.grad = None
    loss = fn(x, w, target)
    (loss * upstream).sum().backward()
    return loss.detach(), x.grad, w.grad


def upstreams(shape, seed=1):
    """Upstream per-token gradients: the same for all (a mean), a 0/1 loss mask, arbitrary."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(shape, generator=g) < 0.7).float()
    return {
        "uniform": torch.full(shape, 1 / mask.numel()),
        "mask": mask / mask.sum(),
        "arbitrary": torch.randn(shape, generator=g),
    }


@pytest.mark.parametrize("linear", ["onednn", "torch"])  # the chooser's two fp32 candidates
@pytest.mark.parametrize("chunk", [8, 39, 1000])  # uneven chunks, one chunk per call
def test_fp32_equals_unfused(monkeypatch, chunk, linear):
    monkeypatch.setattr(policy, "_choices", KernelChoices(linear=linear))
    x, w, target = inputs(torch.float32)
    for name, up in upstreams(target.shape).items():

        def fused(x, w, t):
            return fused_linear_cross_entropy(x, w, t, vocab_size=V, chunk_size=chunk)

        loss, gx, gw = loss_and_grads(fused, x, w, target, up)
        ref_loss, ref_gx, ref_gw = loss_and_grads(unfused, x, w, target, up)
        assert loss.shape == target.shape and loss.dtype == torch.float32
        assert_close(loss, ref_loss, what=f"loss, {name}")
        assert_close(gx, ref_gx, what=f"grad x, {name}")
        assert gw.shape == (V_PAD, H)
        assert_close(gw, ref_gw, what=f"grad W, {name}")
        assert torch.all(gw[V:] == 0), "padding rows get no gradient"


# The chooser's two 16-bit matmuls: torch's own, and the fp32 GEMM on upcast copies (whose
# unfused twin is the layers' upcast linear)
MATMUL16 = {"native": F.linear, "fp32": upcast.linear}


@pytest.mark.parametrize("matmul16", MATMUL16)
def test_bf16_within_rounding_of_unfused(monkeypatch, matmul16):
    monkeypatch.setattr(policy, "_choices", KernelChoices(matmul16=matmul16))
    x, w, target = inputs(torch.bfloat16, tokens=(4, 32))
    exact = [t.detach().double().requires_grad_() for t in (x, w)]
    for name, up in upstreams(target.shape).items():

        def fused(x, w, t):
            return fused_linear_cross_entropy(x, w, t, vocab_size=V, chunk_size=48)

        def plain(x, w, t):
            return unfused(x, w, t, MATMUL16[matmul16])

        loss, gx, gw = loss_and_grads(fused, x, w, target, up)
        ref_loss, ref_gx, ref_gw = loss_and_grads(plain, x, w, target, up)
        true_loss, true_gx, true_gw = loss_and_grads(unfused, *exact, target, up.double())
        assert loss.dtype == torch.float32 and gx.dtype == gw.dtype == torch.bfloat16
        # The forward is the unfused one, op for op: the same bf16 logits, the same fp32 loss.
        assert_close(loss, ref_loss, what=f"loss, {name}")
        # Gradients: no further from float64 truth than the unfused path's (bf16 rounding).
        for ours, theirs, true in ((gx, ref_gx, true_gx), (gw, ref_gw, true_gw)):
            err = (ours.double() - true).norm() / true.norm()
            ref_err = (theirs.double() - true).norm() / true.norm()
            assert err < max(2 * ref_err, 4e-3), (name, err.item(), ref_err.item())
        assert torch.all(gw[V:] == 0)


def test_bf16_loss_where_the_target_probability_underflows():
    x, w, target = inputs(torch.bfloat16)
    with torch.no_grad():  # token 0: logit 200 for id 1, 0 for all others; target id 2
        x[0, 0] = 0.0
        x[0, 0, 0] = 200.0
        w[:, 0] = 0.0
        w[1, 0] = 1.0
    target[0, 0] = 2  # p = exp(-200): 0 in fp32, yet the loss is 200
    up = upstreams(target.shape)["uniform"]

    def fused(x, w, t):
        return fused_linear_cross_entropy(x, w, t, vocab_size=V, chunk_size=16)

    loss, gx, gw = loss_and_grads(fused, x, w, target, up)
    ref_loss, ref_gx, ref_gw = loss_and_grads(unfused, x, w, target, up)
    assert loss[0, 0].item() == pytest.approx(200.0)
    assert_close(loss, ref_loss, what="loss")
    assert_close(gx, ref_gx, rtol=1e-2, what="grad x")  # bf16
    assert_close(gw, ref_gw, rtol=1e-2, what="grad W")


def test_no_grad_and_partial_grads():
    x, w, target = inputs(torch.float32)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(x, w, target, vocab_size=V, chunk_size=7)
    assert_close(loss, unfused(x, w, target).detach(), what="loss")
    frozen = w.detach()  # only the input needs a gradient
    x.grad = None
    fused_linear_cross_entropy(x, frozen, target, vocab_size=V, chunk_size=7).sum().backward()
    ref = x.detach().requires_grad_()
    unfused(ref, frozen, target).sum().backward()
    assert_close(x.grad, ref.grad, what="grad x")


def test_second_backward_is_refused():
    x, w, target = inputs(torch.float32)
    loss = fused_linear_cross_entropy(x, w, target, vocab_size=V).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()  # the gradients were handed over (and scaled in place) by the first one


@pytest.mark.parametrize(
    "dtype,matmul16,buffers",
    [
        (torch.bfloat16, "native", ["16bit", "fp32", "grad_w_t"]),
        (torch.bfloat16, "fp32", ["16bit", "fp32", "grad_w_fp32", "weight_fp32"]),
        (torch.float32, "native", ["fp32", "grad_slice"]),
    ],
)
def test_workspace_is_reused_and_changes_nothing(monkeypatch, dtype, matmul16, buffers):
    choices = KernelChoices(matmul16=matmul16, loss_chunk=9)  # fp32: 9 columns per slice
    monkeypatch.setattr(policy, "_choices", choices)
    x, w, target = inputs(dtype)
    up = upstreams(target.shape)["arbitrary"]  # backward recomputes through the workspace too
    workspace = ChunkWorkspace()

    def fused(x, w, t, ws=None):
        return fused_linear_cross_entropy(x, w, t, vocab_size=V, chunk_size=16, workspace=ws)

    ref = loss_and_grads(fused, x, w, target, up)
    first = loss_and_grads(lambda *a: fused(*a, ws=workspace), x, w, target, up)
    ptrs = {k: b.data_ptr() for k, b in workspace._buffers.items()}
    assert sorted(ptrs) == buffers
    again = loss_and_grads(lambda *a: fused(*a, ws=workspace), x, w, target, up)
    assert {k: b.data_ptr() for k, b in workspace._buffers.items()} == ptrs
    for a, b, c in zip(ref, first, again):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("chunk", [8, 39, 1000])
def test_fp32_vocab_slices_equal_one_product(monkeypatch, chunk):
    """On CPU the fp32 logits and grad_W come from oneDNN in vocabulary slices (``loss_chunk``):
    7 columns (V = 50: the last slice is 1 column wide), 1 column, and
    unsliced, all equal within 1e-6 and to the unfused path."""
    x, w, target = inputs(torch.float32)
    calls = []  # (tokens, vocabulary columns) of each grad_W product
    real = fce._onednn_linear

    def spy(a, b):  # grad_W: a @ x^T, a = grad_logits slice^T [S, tokens]; grad x: a @ W_s^T
        if b.untyped_storage().data_ptr() != w.untyped_storage().data_ptr():
            calls.append((a.shape[1], a.shape[0]))
        return real(a, b)

    monkeypatch.setattr(fce, "_onednn_linear", spy)

    def run(columns, up):
        monkeypatch.setattr(policy, "_choices", KernelChoices(loss_chunk=columns))
        calls.clear()

        def fused(x, w, t):
            return fused_linear_cross_entropy(x, w, t, vocab_size=V, chunk_size=chunk)

        return loss_and_grads(fused, x, w, target, up)

    tokens = target.numel()
    for name, up in upstreams(target.shape).items():
        passes = -(-tokens // chunk) * (1 if name == "uniform" else 2)  # + backward recomputes
        whole = run(1 << 40, up)
        assert [c for _, c in calls] == [V] * passes  # one product per chunk
        ref = loss_and_grads(unfused, x, w, target, up)
        for columns in (7, 1):
            sliced = run(columns, up)
            assert all(c <= columns for _, c in calls)
            assert sum(c for _, c in calls) == V * passes and len(calls) > passes
            if columns == 1:
                assert {c for _, c in calls} == {1}
            for what, a, b, r in zip(("loss", "grad x", "grad W"), sliced, whole, ref):
                assert_close(a, b, what=f"{what}, {name}, sliced vs whole, {columns} columns")
                assert_close(a, r, what=f"{what}, {name}, sliced vs unfused, {columns} columns")
            assert torch.all(sliced[2][V:] == 0), "padding rows get no gradient"


def test_fp32_grad_x_does_not_depend_on_the_chunks(monkeypatch):
    """Each token's grad_x sums the same vocabulary slices in the same order whatever chunks the
    tokens are cut in (slices of a fixed column count): 8-, 13- and 39-token chunks and one
    whole chunk give the same bits for it (and for the loss), where the GEMM's rows do not
    depend on the row count (checked first), else the same within 1e-6."""
    monkeypatch.setattr(policy, "_choices", KernelChoices(loss_chunk=7))  # V = 50: 8 slices
    x, w, target = inputs(torch.float32)
    up = upstreams(target.shape)["uniform"]
    runs = []
    for chunk in (8, 13, 39, target.numel()):

        def fused(x, w, t, chunk=chunk):
            return fused_linear_cross_entropy(x, w, t, vocab_size=V, chunk_size=chunk)

        runs.append(loss_and_grads(fused, x, w, target, up))
    if _rows_independent(x.reshape(-1, x.shape[-1]), w[:7], (8, 13)):
        for loss, grad_x, _ in runs[1:]:
            assert torch.equal(loss, runs[0][0]) and torch.equal(grad_x, runs[0][1])
    else:  # this oneDNN's rows depend on how many are in the call: within an ulp or two
        for loss, grad_x, _ in runs[1:]:
            torch.testing.assert_close(loss, runs[0][0], rtol=1e-6, atol=0)
            torch.testing.assert_close(grad_x, runs[0][1], rtol=1e-6, atol=1e-7)


def _rows_independent(x: torch.Tensor, w: torch.Tensor, counts: tuple[int, ...]) -> bool:
    """Whether the fp32 GEMM the fused loss runs (one vocabulary slice ``w``) gives each row of
    ``x @ w.T`` the same bits whatever number of rows is in the call. oneDNN 3.12 (torch 2.13)
    does here for 2 rows or more; oneDNN 3.10 (torch 2.11) does not once the inner dimension
    is 24 or more."""
    from zerotron.kernels.onednn import _mm_t_op

    whole = _mm_t_op(x, w)
    return all(torch.equal(_mm_t_op(x[:n], w), whole[:n]) for n in counts)


def test_default_chunk_size_splits_evenly():
    assert default_chunk_size(2048, 50257) == 512
    assert default_chunk_size(100, 50257) == 100  # one chunk
    n = default_chunk_size(1100, 50257)  # three chunks of 367, 367, 366
    assert n == 367 and -(-1100 // n) == 3


def gpt(dtype=torch.float32) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=16,
        vocab_size=128,
        orig_vocab_size=100,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return GPT(cfg).to(dtype)


def gpt_batch():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 100, (3, 16), generator=g)
    labels = torch.randint(0, 100, (3, 16), generator=g)
    mask = (torch.rand(3, 16, generator=g) < 0.8).float()
    return tokens, labels, mask


def masked_mean_grads(model, loss, mask):
    model.zero_grad(set_to_none=True)
    ((loss * mask).sum() / mask.sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_gpt_loss_and_grads_equal_logits_path():
    """The model's fused loss gives the loss and every parameter gradient of cross entropy over
    its own logits, under a loss mask (tied embedding: both gradient paths)."""
    model = gpt()
    tokens, labels, mask = gpt_batch()
    logits = model(tokens)[..., :100]
    ref_loss = F.cross_entropy(logits.reshape(-1, 100), labels.reshape(-1), reduction="none")
    ref_loss = ref_loss.view(3, 16)
    ref = masked_mean_grads(model, ref_loss, mask)
    loss = model(tokens, labels=labels)
    assert loss.shape == (3, 16) and loss.dtype == torch.float32
    assert_close(loss, ref_loss.detach(), what="loss")
    ours = masked_mean_grads(model, loss, mask)
    for name, grad in ref.items():  # through the whole model: a few more roundings
        assert_close(ours[name], grad, rtol=1e-5, what=name)
    assert torch.all(ours["embedding.word_embeddings.weight"][100:] == 0)


def test_gpt_under_torch_compile_runs_the_fused_loss_eagerly():
    """``torch.compile(model)`` stops its graph before the fused loss, which runs eagerly."""
    model = gpt()
    tokens, labels, mask = gpt_batch()
    eager_loss = model(tokens, labels=labels)
    eager = masked_mean_grads(model, eager_loss, mask)
    compiled = torch.compile(model)
    loss = compiled(tokens, labels=labels)
    assert_close(loss, eager_loss.detach(), rtol=1e-5, what="loss")
    ours = masked_mean_grads(model, loss, mask)
    for name, grad in eager.items():
        assert_close(ours[name], grad, rtol=1e-5, what=name)

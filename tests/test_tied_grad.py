"""The tied embedding's lookup adds its gradient rows into the fused loss's weight gradient."""

import torch
import torch.nn.functional as F

from zerotron.kernels import fused_linear_cross_entropy
from zerotron.kernels.tied_grad import TiedGrad, embedding_lookup

H, V, V_PAD = 16, 40, 48


def setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V_PAD, H, generator=g).requires_grad_()
    tokens = torch.randint(0, V, (3, 11), generator=g)
    tokens[0, :4] = 7  # a repeated token: its rows sum in token order
    target = torch.randint(0, V, (3, 11), generator=g)
    return w, tokens, target


def loss_of(x, w, target, tied=None):
    return fused_linear_cross_entropy(x * 1.5, w, target, vocab_size=V, tied=tied).mean()


def test_rows_are_added_into_the_loss_gradient_itself(monkeypatch):
    w, tokens, target = setup()
    # expected: the loss's own weight gradient, then each token's row added, in token order
    x_leaf = F.embedding(tokens, w.detach()).requires_grad_()
    loss_of(x_leaf, w, target).backward()
    expected = w.grad.clone().index_add_(0, tokens.reshape(-1), x_leaf.grad.reshape(-1, H))

    handed = []
    put = TiedGrad.put
    # (the address only: holding the tensor would make autograd copy it into .grad)
    monkeypatch.setattr(
        TiedGrad, "put", lambda self, g: (handed.append(g.data_ptr()), put(self, g))
    )
    w.grad = None
    tied = TiedGrad()
    loss_of(embedding_lookup(tokens, w, tied), w, target, tied).backward()
    assert torch.equal(w.grad, expected)
    # no copy anywhere: .grad is the very tensor the loss made, and the slot let go of it
    assert handed == [w.grad.data_ptr()]
    assert tied.grad is None


def test_equals_autograd_sum_of_both_gradients():
    w, tokens, target = setup(1)
    loss_of(F.embedding(tokens, w), w, target).backward()
    ref = w.grad.clone()
    w.grad = None
    tied = TiedGrad()
    loss_of(embedding_lookup(tokens, w, tied), w, target, tied).backward()
    torch.testing.assert_close(w.grad, ref, rtol=1e-6, atol=1e-7)


def test_without_a_loss_gradient_the_lookup_returns_its_own():
    """The loss does not differentiate the weight (a frozen copy): the slot stays empty and the
    lookup's backward gives the plain embedding gradient."""
    w, tokens, target = setup(2)
    F.embedding(tokens, w).pow(2).sum().backward()
    ref = w.grad.clone()
    w.grad = None
    tied = TiedGrad()
    x = embedding_lookup(tokens, w, tied)
    (loss_of(x, w.detach(), target, tied) * 0 + x.pow(2).sum()).backward()
    assert torch.equal(w.grad, ref)


def test_micro_batches_forward_first_then_one_backward():
    """Several forwards, each with its own slot, then one backward: autograd meets the loss
    gradients of all of them before any lookup's backward, and every row still lands."""
    w, tokens, target = setup(3)
    batches = [(tokens, target), (tokens.flip(1), target.flip(0)), (tokens[:1], target[:1])]
    torch.stack([loss_of(F.embedding(t, w), w, y) for t, y in batches]).sum().backward()
    ref = w.grad.clone()
    w.grad = None
    losses = []
    for t, y in batches:
        tied = TiedGrad()
        losses.append(loss_of(embedding_lookup(t, w, tied), w, y, tied))
    torch.stack(losses).sum().backward()
    torch.testing.assert_close(w.grad, ref, rtol=1e-6, atol=1e-7)

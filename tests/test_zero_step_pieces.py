"""step_in_pieces: stepping a flat master piece by piece is the whole-tensor step, bit for bit."""

from __future__ import annotations

import pytest
import torch

from zerotron.zero.masters import step_in_pieces

OPTIMIZERS = {
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
    "adamw_amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1, amsgrad=True),
    "adam_foreach": lambda p: torch.optim.Adam(p, lr=1e-3, foreach=True),
    "sgd_momentum_dampening": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.1),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_pieces_equal_whole_step(name: str) -> None:
    make = OPTIMIZERS[name]
    torch.manual_seed(0)
    n = 10_003  # not a multiple of the piece: a short last piece
    a, b = torch.randn(n, requires_grad=True), torch.randn(77, requires_grad=True)
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    whole = make([{"params": [a]}, {"params": [b]}])
    pieces = make([{"params": [a2]}, {"params": [b2]}])
    for _ in range(3):
        ga, gb = torch.randn(n).bfloat16(), torch.randn(77)
        a.grad, b.grad = ga.float(), gb
        whole.step()
        step_in_pieces(pieces, 0, a2, lambda x, y, g=ga: g[x:y].float(), piece=1024)
        step_in_pieces(pieces, 1, b2, lambda x, y, g=gb: g[x:y], piece=1024)
        assert torch.equal(a, a2) and torch.equal(b, b2)
    # The state is whole again (keyed by the masters, the same entries, equal bits) and the
    # groups point at the masters: checkpoints see no trace of the pieces.
    assert pieces.param_groups[0]["params"][0] is a2
    sd, sd2 = whole.state_dict(), pieces.state_dict()
    assert sd["param_groups"] == sd2["param_groups"]
    assert sd["state"].keys() == sd2["state"].keys()
    for k, entries in sd["state"].items():
        assert entries.keys() == sd2["state"][k].keys()
        for key, v in entries.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(sd2["state"][k][key])), key

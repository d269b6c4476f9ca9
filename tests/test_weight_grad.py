"""The zero-bubble split of a backward (input gradient at B, weight gradient at W) gives exactly
the gradients of one plain backward, on stages built to stress it."""

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_pp.runtime.plans.weight_grad import backward_input


class Stage(nn.Module):
    """A weight used twice, a parameter added to activations, layer norm, a parameter-only second
    output, an unused layer and (optionally) a checkpointed layer."""

    def __init__(self, checkpointing=None):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.ln = nn.LayerNorm(6)
        self.shared = nn.Parameter(torch.randn(6, 6))
        self.pos = nn.Parameter(torch.randn(6))
        self.unused = nn.Linear(2, 2)
        self.checkpointing = checkpointing

    def forward(self, x):
        h = torch.tanh((self.a(x) + self.pos) @ self.shared)
        if self.checkpointing is None:
            h = self.b(h)
        else:
            h = checkpoint(self.b, h, use_reentrant=self.checkpointing == "reentrant")
        h = self.ln(h) @ self.shared.t()
        return self.c(h), (self.pos * self.pos).sum()


@pytest.mark.parametrize("checkpointing", [None, "non_reentrant", "reentrant"])
@pytest.mark.parametrize("input_needs_grad", [True, False])
def test_split_backward_equals_one_backward(checkpointing, input_needs_grad):
    torch.manual_seed(0)
    split = Stage(checkpointing).double()
    whole = copy.deepcopy(split)
    x = torch.randn(3, 6, dtype=torch.float64)
    grads = [torch.randn(3, 6, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64)]

    x_whole = x.clone().requires_grad_(input_needs_grad)
    torch.autograd.backward(list(whole(x_whole)), grads)

    x_split = x.clone().requires_grad_(input_needs_grad)
    input_grads, weights = backward_input(list(split(x_split)), grads, [x_split], list(split.parameters()))
    if input_needs_grad:
        torch.testing.assert_close(input_grads[0], x_whole.grad, rtol=0, atol=0)
        if checkpointing != "reentrant":  # reentrant layers run whole at B (see weight_grad.py)
            assert all(p.grad is None for p in split.parameters()), "B must not touch weight gradients"
    weights.run()
    for (name, p), q in zip(split.named_parameters(), whole.parameters()):
        if q.grad is None:
            assert p.grad is None, f"{name}: one backward leaves no gradient, the split made one"
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-15, msg=name)
    assert split.unused.weight.grad is None


def test_weight_gradients_accumulate_like_backward():
    torch.manual_seed(1)
    split = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4)).double()
    whole = copy.deepcopy(split)
    for _ in range(3):  # three microbatches into the same .grad
        x = torch.randn(2, 4, dtype=torch.float64)
        g = torch.randn(2, 4, dtype=torch.float64)
        xw = x.clone().requires_grad_()
        whole(xw).backward(g)
        xs = x.clone().requires_grad_()
        _, work = backward_input([split(xs)], [g], [xs], list(split.parameters()))
        work.run()
    for p, q in zip(split.parameters(), whole.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-14)

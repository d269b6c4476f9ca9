"""Compiled layers under the zero-bubble split (lightning_pp.runtime.compile.layers): the runtime's B
computes only input gradients, its W only weight gradients, together equal to one eager backward
and with no matmul computed twice."""

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_pp.runtime.compile.layers import compile_layer
from lightning_pp.runtime.plans.weight_grad import backward_input
from lightning_pp.runtime.process import CHECKPOINT, CHECKPOINT_COMPILED, fact, facts


class Block(nn.Module):
    def __init__(self, width: int = 24) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down, self.out = nn.Linear(width, 2 * width), nn.Linear(2 * width, width), nn.Linear(width, width)

    def forward(self, x):
        return x + self.out(torch.tanh(self.down(torch.nn.functional.gelu(self.up(self.norm(x))))))


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _two_layers(dtype):
    torch.manual_seed(0)
    eager = nn.Sequential(Block(), Block()).to(dtype)
    return eager, copy.deepcopy(eager)


def _split_backward(model, x, g):
    y = model(x)
    (gx,), weights = backward_input([y], [g], [x], list(model.parameters()))
    return gx, weights


def test_compiled_split_equals_eager_and_computes_nothing_twice():
    eager, compiled = _two_layers(torch.float64)
    for layer in compiled:
        compile_layer(layer, compiler="aot_eager")
    x0, g = torch.randn(6, 5, 24, dtype=torch.float64), torch.randn(6, 5, 24, dtype=torch.float64)
    x = x0.clone().requires_grad_()
    eager(x).backward(g)
    y = eager(x0.clone().requires_grad_())
    with CountMatmuls() as whole:  # the backward's matmuls only
        y.backward(g)
    for p in eager.parameters():
        p.grad = p.grad / 2  # two backwards above
    for _ in range(2):  # the second step reuses the compiled parts
        for p in compiled.parameters():
            p.grad = None
        xc = x0.clone().requires_grad_()
        y = compiled(xc)
        with CountMatmuls() as b_count:
            (gx,), weights = backward_input([y], [g], [xc], list(compiled.parameters()))
        assert all(p.grad is None for p in compiled.parameters())  # B left the weights alone
        torch.testing.assert_close(gx, x.grad, rtol=1e-12, atol=1e-12)
        with CountMatmuls() as w_count:
            weights.run()
        for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)
        assert b_count.count > 0 and w_count.count > 0
        assert b_count.count + w_count.count == whole.count  # nothing computed twice
    assert "_orig_mod" not in "".join(compiled.state_dict())


def test_compiled_plain_backward_is_whole():
    eager, compiled = _two_layers(torch.float64)
    for layer in compiled:
        compile_layer(layer, compiler="aot_eager")
    x0, g = torch.randn(3, 7, 24, dtype=torch.float64), torch.randn(3, 7, 24, dtype=torch.float64)
    for model in (eager, compiled):
        model(x0.clone().requires_grad_()).backward(g)
    for p, q in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.timeout(300)
def test_inductor_split_matches_eager():
    eager, compiled = _two_layers(torch.float32)
    for layer in compiled:
        compile_layer(layer)
    x0, g = torch.randn(4, 8, 24), torch.randn(4, 8, 24)
    x = x0.clone().requires_grad_()
    eager(x).backward(g)
    xc = x0.clone().requires_grad_()
    gx, weights = _split_backward(compiled, xc, g)
    assert all(p.grad is None for p in compiled.parameters())
    weights.run()
    torch.testing.assert_close(gx, x.grad, rtol=1e-4, atol=1e-5)
    for p, q in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)


def test_a_deep_copy_of_a_compiled_layer_computes_with_its_own_weights():
    """EMA and SWA callbacks deep-copy the module: the copy's compiled forward must read the copy's
    parameters (a compiled bound method would keep the original's), for torch's own classes too."""
    for make in (lambda: Block(8), lambda: nn.Linear(8, 8)):
        layer = compile_layer(make().double(), compiler="aot_eager")
        x = torch.randn(3, 8, dtype=torch.float64)
        layer(x)
        twin = copy.deepcopy(layer)
        with torch.no_grad():
            for p in twin.parameters():
                p.mul_(2.0)
        eager = copy.deepcopy(twin)
        eager.forward = type(eager).forward.__get__(eager)  # the class's forward, uncompiled
        torch.testing.assert_close(twin(x), eager(x), rtol=1e-12, atol=1e-12)
        assert not torch.allclose(twin(x), layer(x))


@pytest.mark.parametrize("split", [False, True])
def test_activation_checkpointing_is_inside_the_compiled_graph(split):
    """A layer marked for activation checkpointing and then compiled recomputes inside its compiled
    backward: its forward saves only its input (and the weights it already holds), not the hidden
    activations an unmarked compiled layer saves; run_layer adds no checkpoint around it; the
    gradients are the eager ones (aot_eager keeps eager's kernels), the zero-bubble split too."""
    from lightning_pp.runtime.layer import run_layer

    def saved_bytes_and_grads(checkpointed: bool):
        torch.manual_seed(0)
        layer = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 64)).double()
        facts(layer)[CHECKPOINT] = checkpointed
        compile_layer(layer, "aot_eager", split=split)
        x = torch.randn(32, 64, dtype=torch.float64, requires_grad=True)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            out = run_layer(layer, x)
        weights = sum(p.numel() * p.element_size() for p in layer.parameters())
        out.sum().backward()
        return sum(saved) - weights, [x.grad, *(p.grad for p in layer.parameters())], layer

    plain, plain_grads, _ = saved_bytes_and_grads(False)
    inside, inside_grads, layer = saved_bytes_and_grads(True)
    assert fact(layer, CHECKPOINT_COMPILED)
    activations = 32 * (256 + 256 + 256 + 256) * 8  # the two hidden layers' pre- and post-tanh values
    assert plain >= activations / 2, plain  # compiled without the checkpoint: hidden activations saved
    assert inside <= 32 * 64 * 8 * 2, inside  # with it: little beyond the input
    for a, b in zip(plain_grads, inside_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)

"""Models written the way users write them, for the cases where a pipeline used to train a
different model than one device (tied weights in any order, parameters without gradients, batches
with per-sample Python lists, dropout), and the one-device training loop they are compared with.

The reference shares no code with the runtime: whole batch, plain autograd, one optimizer."""

from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from models import Layered


class TiedLinear(nn.Module):
    """A linear layer whose weight is another layer's (``transpose``: used as ``W.T``, as a tied
    decoder uses its encoder's weight)."""

    def __init__(self, weight: nn.Parameter, out_features: int, transpose: bool):
        super().__init__()
        self.weight = weight
        self.bias = nn.Parameter(torch.linspace(-0.1, 0.1, out_features))
        self.transpose = transpose

    def forward(self, x):
        w = self.weight.t() if self.transpose else self.weight
        return torch.tanh(F.linear(x, w, self.bias))


class MirrorAutoencoder(Layered):
    """Encoder i shares its weight with decoder n-1-i, so the two pipeline stages list their tied
    copies in opposite orders. ``dims`` equal: every tie has the same shape (pairing the wrong
    tensors trains silently wrong); different: shapes differ (pairing them aborts the reduction)."""

    def __init__(self, dims=(6, 5, 4, 3)):
        super().__init__()
        self.encoder = nn.ModuleList(nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in zip(dims, dims[1:]))
        self.decoder = nn.ModuleList(
            TiedLinear(self.encoder[i][0].weight, dims[i], transpose=True) for i in reversed(range(len(dims) - 1))
        )

    def pipeline_layers(self):
        return [*self.encoder, *self.decoder]


class SharedGainBlock(nn.Module):
    """A residual block that also applies the shared matrices it is given (ties spanning any set
    of layers; each tie has its own shape)."""

    def __init__(self, hidden: int, shared: list):
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)
        self.shared = nn.ParameterList(shared)

    def forward(self, h):
        h = h + 0.5 * torch.tanh(self.fc(h))
        for w in self.shared:
            h = h + 0.3 * torch.tanh(h @ w.t()) @ w
        return h


class TieNet(Layered):
    """``ties[k]`` lists the layers that share matrix ``k`` (shape ``(k + 2, hidden)``). Layers are
    built in order, so a layer lists its shared matrices in the order given by ``ties``."""

    def __init__(self, num_layers: int, ties: list[list[int]], hidden: int = 6, order: Optional[dict] = None):
        super().__init__()
        gen = torch.Generator().manual_seed(5)
        shared = [nn.Parameter(0.4 * torch.randn(k + 2, hidden, generator=gen)) for k in range(len(ties))]
        self.inp = nn.Linear(4, hidden)
        blocks = []
        for i in range(num_layers):
            mine = [k for k in range(len(ties)) if i in ties[k]]
            if order and i in order:  # this layer lists its ties in another order
                mine = order[i]
            blocks.append(SharedGainBlock(hidden, [shared[k] for k in mine]))
        self.blocks = nn.ModuleList(blocks)
        self.out = nn.Linear(hidden, 2)

    def pipeline_layers(self):
        return [self.inp, *self.blocks, self.out]


class Gated(nn.Module):
    """A block with a parameter that never receives a gradient (``unused``), one behind a
    stop-gradient (``frozen_path``: its output is detached), and a branch taken only when the
    batch's first feature is large (``branch``): on one device their ``.grad`` stays ``None``."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)
        self.unused = nn.Linear(hidden, hidden)
        self.frozen_path = nn.Linear(hidden, hidden)
        self.branch = nn.Linear(hidden, hidden)

    def forward(self, h):
        h = h + torch.tanh(self.fc(h)) + self.frozen_path(h).detach()
        if bool((h[:, 0] > 50).any()):  # never true for these data: the branch is not taken
            h = h + self.branch(h)
        return h


class StopGradient(nn.Module):
    """Cuts the gradient to everything before it (a frozen feature extractor ahead of it)."""

    def forward(self, h):
        return h.detach()


class NoGradNet(Layered):
    """Parameters without gradients on every stage, and a stop-gradient at a stage boundary: the
    stages before it get no gradient at all."""

    def __init__(self, hidden: int = 6, stop_after: Optional[int] = 1):
        super().__init__()
        self.inp = nn.Linear(4, hidden)
        layers: list[nn.Module] = [Gated(hidden) for _ in range(4)]
        if stop_after is not None:
            layers.insert(stop_after, StopGradient())
        self.blocks = nn.ModuleList(layers)
        self.out = nn.Linear(hidden, 2)

    def pipeline_layers(self):
        return [self.inp, *self.blocks, self.out]


class RaggedTargets(Layered):
    """A batch ``{"x": tensor, "targets": [one tensor of its own length per sample], "names":
    [a string per sample]}``: the loss reads sample ``i``'s own target, and checks its name."""

    def __init__(self, hidden: int = 6):
        super().__init__()
        self.inp = nn.Linear(4, hidden)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) for _ in range(3))
        self.out = nn.Linear(hidden, 5)

    def pipeline_layers(self):
        return [self.inp, *self.blocks, self.out]

    def pipeline_inputs(self, batch):
        return batch["x"]

    def pipeline_loss(self, output, batch):
        assert len(batch["names"]) == len(batch["targets"]) == output.shape[0], (
            f"{len(batch['names'])} names and {len(batch['targets'])} targets for {output.shape[0]} samples")
        losses = []
        for row, target, name in zip(output, batch["targets"], batch["names"]):
            assert name == f"sample{int(target[0])}", (name, target)
            losses.append(F.mse_loss(row[: len(target)], target.to(row.dtype)))
        return torch.stack(losses).mean()


def ragged_batches(seed: int, batch: int, steps: int = 2):
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(steps):
        ids = [step * batch + i for i in range(batch)]
        targets = [torch.cat([torch.tensor([float(i)]), torch.randn(1 + i % 4, generator=g, dtype=torch.float64)])
                   for i in ids]
        out.append({"x": torch.randn(batch, 4, generator=g, dtype=torch.float64), "targets": targets,
                    "names": [f"sample{i}" for i in ids]})
    return out


def plain_batches(seed: int, batch: int, steps: int = 3, dim_in: int = 4, dim_out: int = 2):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, dim_in, generator=g, dtype=torch.float64),
             torch.randn(batch, dim_out, generator=g, dtype=torch.float64)) for _ in range(steps)]


def adamw(params):
    # Weight decay moves a parameter that has a gradient (even a zero one) but not one whose
    # gradient is None: the difference shows in the parameters after one step.
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def reference_steps(model: nn.Module, batches, max_norm: Optional[float] = None):
    """One-device training: returns (losses, grads per step by name, None where no gradient,
    final parameters)."""
    model = copy.deepcopy(model)
    opt = adamw(model.parameters())
    losses, grads = [], []
    for batch in batches:
        inputs = model.pipeline_inputs(batch) if hasattr(model, "pipeline_inputs") else batch[0]
        loss = model.pipeline_loss(model(inputs), batch)
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        grads.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def pipelined_steps(executor, model: nn.Module, batches, max_norm: Optional[float] = None):
    """The same training through ``executor`` (each data-parallel rank takes its share of every
    batch: tensors and per-sample lists alike)."""
    from lightning_pp.runtime.dp.norm import clip_grad_norm_

    names, topo = executor.partition.parameter_names, executor.topology
    opt = adamw(model.parameters())
    losses, grads = [], []
    for batch in batches:
        result = executor.train_step(dp_share(batch, topo.dp, topo.dp_rank))
        if max_norm is not None:
            clip_grad_norm_(executor.grad_sync, topo, executor.partition, max_norm)
        grads.append({names[id(p)]: None if p.grad is None else p.grad.clone() for p in model.parameters()})
        opt.step()
        opt.zero_grad()
        losses.append(float(result.loss))
    return losses, grads, {names[id(p)]: p.detach().clone() for p in model.parameters()}


def dp_share(batch, dp: int, dp_rank: int):
    if dp == 1:
        return batch
    size = len(batch[0]) if isinstance(batch, (tuple, list)) else len(batch["x"])

    def cut(obj):
        if isinstance(obj, torch.Tensor) or isinstance(obj, list):
            rows = list(range(size))
            share = [rows[i] for i in range(len(rows)) if i * dp // size == dp_rank]
            return obj[share[0]: share[-1] + 1]
        if isinstance(obj, dict):
            return {k: cut(v) for k, v in obj.items()}
        return type(obj)(cut(v) for v in obj)

    return cut(batch)


def compare(case, reference, per_rank, rtol=1e-9, atol=1e-12):
    ref_losses, ref_grads, ref_params = reference
    seen = set()
    for rank, (losses, grads, params) in enumerate(per_rank):
        assert losses == [pytest_approx(v, rtol) for v in ref_losses], f"{case}: rank {rank} losses {losses} != {ref_losses}"
        for step, step_grads in enumerate(grads):
            for name, value in step_grads.items():
                want = ref_grads[step][name]
                if want is None or value is None:
                    assert value is None and want is None, (
                        f"{case}: step {step} rank {rank}: {name}.grad is {'None' if value is None else 'a tensor'} "
                        f"here but {'None' if want is None else 'a tensor'} on one device")
                    continue
                torch.testing.assert_close(value, want, rtol=rtol, atol=atol, msg=f"{case}: grad {name} step {step} rank {rank}")
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=rtol, atol=atol, msg=f"{case}: param {name} rank {rank}")
            seen.add(name)
    assert seen == set(ref_params), f"{case}: parameters on no rank: {set(ref_params) - seen}"


def pytest_approx(value, rtol):
    import pytest

    return pytest.approx(value, rel=rtol, abs=1e-12)


class DropoutBlock(nn.Module):
    def __init__(self, hidden: int, p: float = 0.5):
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)
        self.drop = nn.Dropout(p)

    def forward(self, h):
        return h + self.drop(torch.tanh(self.fc(h)))


class DropoutNet(Layered):
    """Every block draws a dropout mask of the same shape, so a stage that starts from another
    stage's generator state draws that stage's masks."""

    def __init__(self, hidden: int = 8, blocks: int = 4):
        super().__init__()
        self.inp = nn.Linear(4, hidden)
        self.blocks = nn.ModuleList(DropoutBlock(hidden) for _ in range(blocks))
        self.out = nn.Linear(hidden, 2)

    def pipeline_layers(self):
        return [self.inp, *self.blocks, self.out]


def record_dropout_masks(model: nn.Module) -> dict:
    """name of each Dropout -> the masks it drew, in call order (recomputations included)."""
    masks: dict[str, list] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout):
            module.register_forward_hook(
                lambda mod, args, out, name=name: masks.setdefault(name, []).append((out == 0).clone()))
    return masks

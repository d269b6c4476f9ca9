"""Small models that implement the pipeline protocol, and the single-process reference loop the
pipelined runs are compared against. The reference runs the layers in order on the whole batch
with plain autograd: it shares no code with the pipeline runtime."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 2 * hidden)
        self.fc2 = nn.Linear(2 * hidden, hidden)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class CheckpointedBlock(Block):
    """A block that recomputes its activations in backward (torch.utils.checkpoint), as users do
    to save memory; ``reentrant`` picks the old autograd-Function implementation."""

    def __init__(self, hidden: int, reentrant: bool = False):
        super().__init__(hidden)
        self.reentrant = reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(super().forward, x, use_reentrant=self.reentrant)


class Layered(nn.Module):
    """The pipeline protocol of a model whose layers run in order: a mean squared error against
    ``batch[1]``, and a one-device forward that runs the layers in turn."""

    def pipeline_loss(self, output, batch):
        return F.mse_loss(output, batch[1])

    def forward(self, x):
        for layer in self.pipeline_layers():
            x = layer(x)
        return x


class ToyRegressor(Layered):
    """Linear in, residual blocks, linear out; mean squared error. ``checkpoint``: None, or
    ``"reentrant"`` / ``"non_reentrant"`` activation checkpointing in every block."""

    def __init__(self, dim_in=5, hidden=8, dim_out=3, blocks=4, checkpoint=None):
        super().__init__()
        self.embed = nn.Linear(dim_in, hidden)
        self.blocks = nn.ModuleList(
            Block(hidden) if checkpoint is None else CheckpointedBlock(hidden, reentrant=checkpoint == "reentrant")
            for _ in range(blocks)
        )
        self.head = nn.Linear(hidden, dim_out)

    def pipeline_layers(self):
        return [self.embed, *self.blocks, self.head]


class TiedLM(nn.Module):
    """Token embedding shared with the output head; cross entropy over every token, returned as
    (sum, count) when ``token_sum`` so the normaliser is the global token count."""

    def __init__(self, vocab=11, hidden=8, blocks=3, token_sum=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(blocks))
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.token_sum = token_sum

    def pipeline_layers(self):
        return [self.embed, *self.blocks, self.head]

    def pipeline_loss(self, logits, batch):
        targets = batch[1]
        if self.token_sum:
            mask = targets >= 0
            loss = F.cross_entropy(logits.flatten(0, 1), targets.clamp(min=0).flatten(), reduction="none")
            return (loss * mask.flatten()).sum(), mask.sum()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def forward(self, x):
        for layer in self.pipeline_layers():
            x = layer(x)
        return x


class MaskedIn(nn.Module):
    def __init__(self, dim_in, hidden):
        super().__init__()
        self.proj = nn.Linear(dim_in, hidden)

    def forward(self, x, mask):
        return self.proj(x) * mask, mask


class MaskedBlock(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, h, mask):
        return h + torch.tanh(self.fc(h)) * mask, mask


class MaskedOut(nn.Module):
    def __init__(self, hidden, dim_out):
        super().__init__()
        self.fc = nn.Linear(hidden, dim_out)

    def forward(self, h, mask):
        return self.fc(h)


class TupleBoundaryNet(nn.Module):
    """Stages pass ``(hidden, mask)`` tuples; the mask is a non-differentiable bool-derived tensor."""

    def __init__(self, dim_in=4, hidden=6, dim_out=2, blocks=3):
        super().__init__()
        self.inp = MaskedIn(dim_in, hidden)
        self.blocks = nn.ModuleList(MaskedBlock(hidden) for _ in range(blocks))
        self.out = MaskedOut(hidden, dim_out)

    def pipeline_layers(self):
        return [self.inp, *self.blocks, self.out]

    def pipeline_inputs(self, batch):
        return (batch[0], batch[2])

    def pipeline_loss(self, output, batch):
        return F.mse_loss(output, batch[1])

    def forward(self, batch_inputs):
        x = self.inp(*batch_inputs)
        for block in self.blocks:
            x = block(*x)
        return self.out(*x)


def reference_run(model: nn.Module, batches, lr: float = 0.1, optimizer: str = "sgd"):
    """Train ``model`` on one process: per step, loss of the whole batch, backward, optimizer step.
    Returns (losses, grads of the first step by name, final parameters by name)."""
    model = copy.deepcopy(model)
    opt = make_optimizer(optimizer, model.parameters(), lr)
    losses, first_grads = [], None
    for batch in batches:
        inputs = model.pipeline_inputs(batch) if hasattr(model, "pipeline_inputs") else batch[0]
        loss = model.pipeline_loss(model(inputs), batch)
        if isinstance(loss, tuple):
            loss = loss[0] / loss[1]
        loss.backward()
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses, first_grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def pipelined_run(executor, model: nn.Module, batches, lr: float = 0.1, optimizer: str = "sgd"):
    """The same training as :func:`reference_run`, through a pipeline executor on this rank (each
    data-parallel rank takes its slice of every batch). Returns (losses, grads of the first step by
    global name, final parameters by global name), for this rank's parameters."""
    names, topo = executor.partition.parameter_names, executor.topology
    opt = make_optimizer(optimizer, model.parameters(), lr)
    losses, first_grads = [], None
    for batch in batches:
        result = executor.train_step(tuple(torch.tensor_split(t, topo.dp)[topo.dp_rank] for t in batch))
        if first_grads is None:
            first_grads = {names[id(p)]: p.grad.clone() for p in model.parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(float(result.loss))
    return losses, first_grads, {names[id(p)]: p.detach().clone() for p in model.parameters()}


def make_optimizer(name, params, lr):
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=lr * 0.1, weight_decay=0.01)

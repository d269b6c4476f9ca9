"""A small MoE language model with the pipeline protocol (float64 in the tests)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_pp.moe import MoEBlock


class Head(nn.Module):
    def __init__(self, hidden, vocab):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x):
        return self.out(self.norm(x))


class TinyMoELM(nn.Module):
    def __init__(self, vocab=13, hidden=8, heads=2, ffn=12, experts=4, top_k=2, blocks=4, aux=0.0, z=0.0,
                 capacity_factor=None, a2a_delay=0.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            MoEBlock(hidden, heads, ffn, experts, top_k, capacity_factor=capacity_factor, aux_loss_coeff=aux,
                     z_loss_coeff=z, a2a_delay=a2a_delay)
            for _ in range(blocks)
        )
        self.head = Head(hidden, vocab)

    def pipeline_layers(self):
        return [self.embed, *self.blocks, self.head]

    def pipeline_loss(self, logits, batch):
        return F.cross_entropy(logits.flatten(0, 1), batch[1].flatten())

    def forward(self, x):
        for layer in self.pipeline_layers():
            x = layer(x)
        return x


def token_batches(seed, batch, seq, steps, vocab=13):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g))
            for _ in range(steps)]



def count_overlaps():
    """Record, for every layer pair combined 1F1B runs together in its steady state (one MoE
    layer's forward with another's backward), whether both communicate. Returns the list it fills
    and the function that stops the recording."""
    from lightning_pp.runtime.plans import nodes

    overlapped: list = []
    plain = nodes._overlapped_layer

    def counting(f, b, x, g):
        overlapped.append(f.communicates and b.communicates)
        return plain(f, b, x, g)

    nodes._overlapped_layer = counting

    def stop() -> None:
        nodes._overlapped_layer = plain

    return overlapped, stop

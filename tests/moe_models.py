"""A small MoE language model with the pipeline protocol (float64 in the tests), and a user's
LightningModule built from the MoE layer docs/moe.md shows."""

from __future__ import annotations

import pathlib
import re

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from lightning_pp.moe import MoEBlock
from models import pipelined_run


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


MOE_STEPS = 3  # steps of the MoE equivalence cases


def tiny_moe(aux=0.0, z=0.0, capacity=None):
    torch.manual_seed(11)
    return TinyMoELM(aux=aux, z=z, capacity_factor=capacity).double()


def run_moe_cases(rank, world, cases):
    from lightning_pp.runtime import build_pipeline

    out = []
    for case in cases:
        model = tiny_moe(case.get("aux", 0.0), case.get("z", 0.0), case.get("capacity"))
        executor = build_pipeline(model, pipeline_parallel_size=case["pp"], virtual_pipeline_size=case["vp"],
                                  num_microbatches=case["m"], schedule=case["schedule"], expert_parallel_size=case["ep"])
        losses, grads, params = pipelined_run(executor, model, token_batches(5, case["batch"], 6, MOE_STEPS))
        pools = [b.pool.stats for b in model.blocks if hasattr(b, "pool") and b.pool is not None]
        stats = dict(after_warmup=sum(s.allocations_after_warmup for s in pools),
                     allocations=sum(s.allocations for s in pools), staged=sum(s.staged_bytes for s in pools),
                     zero_copy=sum(s.zero_copy_bytes for s in pools),
                     a2a_waits=sum(1 for sp in executor.timeline.spans if sp.kind == "a2a_wait"))
        out.append((losses, grads, params, stats))
    return out


# -- a user's MoE layer as docs/moe.md shows it, in a LightningModule ------------------------
MOE_DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "moe.md"
HIDDEN, VOCAB, EXPERTS = 8, 13, 4


def readme_moe_block():
    """The custom MoE layer of docs/moe.md, run as printed."""
    blocks = re.findall(r"```python\n(.*?)```", MOE_DOC.read_text(), re.S)
    (code,) = [b for b in blocks if "class MyMoEBlock(ExpertParallelMoE)" in b]
    namespace: dict = {}
    exec(compile(code, str(MOE_DOC), "exec"), namespace)
    return namespace["MyMoEBlock"]


class UserMoE(L.LightningModule):
    """Embedding, four of the blocks of docs/moe.md, a head; the user's single-device training_step."""

    def __init__(self):
        super().__init__()
        block = readme_moe_block()
        torch.manual_seed(7)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(block(HIDDEN, 12, num_experts=EXPERTS, top_k=2) for _ in range(4))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def pipeline_layers(self):
        return [self.embed, *self.blocks, self.head]

    def pipeline_loss(self, logits, batch):
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten())

    def training_step(self, batch, batch_idx):
        x = batch[0]
        for layer in self.pipeline_layers():
            x = layer(x)
        return self.pipeline_loss(x, batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def user_moe_dataset(n=48, seq=5):
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randint(0, VOCAB, (n, seq), generator=g), torch.randint(0, VOCAB, (n, seq), generator=g))

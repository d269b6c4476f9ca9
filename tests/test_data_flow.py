"""Models that are not a chain of layers, written as users write them, trained through
``Trainer.fit`` with Lightning's defaults under every schedule, against the same Trainer on one
device (float64): a U-Net whose skips cross stages, a DiT-style model whose conditioning tensor
every block uses, an encoder-decoder with two inputs and a mask and integer ids that need no
gradient, a model whose layer output feeds two later layers plus a residual from the first layer to
the last, and a ViT whose ``cls_token``/``pos_embed`` live on the LightningModule. Parameters after
``fit`` and the consolidated checkpoint both equal one device's.

Each of these models sends, at some stage boundary, a tensor that an operation of the sending
stage saved for its backward (the skip a pooling or a convolution read, the conditioning ``SiLU``
read): the runtime must not free what autograd still needs (issue 32). The models are the ones
docs/data-flow.md shows."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

from distributed import run_distributed

SCHEDULES = [("1f1b", 1), ("interleaved", 2), ("gpipe", 1), ("combined_1f1b", 1), ("zb1p", 1), ("zbv", 2),
             ("dualpipev", 2)]
# Non-reentrant activation checkpointing keeps each layer's inputs for its recomputation: a carried
# tensor a checkpointed layer took and the stage sent on must survive the send too.
CHECKPOINTED = ("zbv+checkpointing", 2)
TRAINER = dict(accelerator="cpu", max_epochs=1, precision="64-true", logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
SAMPLES, BATCH = 16, 8  # two steps of 4 microbatches of 2


# -- a 1-d U-Net: the skips ride along as tuple elements -------------------------------------------
class Stem(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 3, padding=1)

    def forward(self, x):
        h = self.conv(x)
        return h, h  # the first skip is the same tensor as the main path


class Down(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, 3, padding=1)

    def forward(self, h, *skips):
        s = torch.tanh(self.conv(h))
        return F.max_pool1d(s, 2), *skips, s  # s: read by the pooling's backward and sent on


class Mid(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, 1)

    def forward(self, h, *skips):
        return F.silu(self.conv(h)), *skips


class Up(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv = nn.Conv1d(2 * channels, channels, 3, padding=1)

    def forward(self, h, *skips):
        h = F.interpolate(h, scale_factor=2.0)
        return self.conv(torch.cat([h, skips[-1]], dim=1)), *skips[:-1]


class UNetHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = nn.Conv1d(3, 2, 1)

    def forward(self, h, first):
        return self.out(h + first)


class UNet(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.stem = Stem()
        self.down = nn.ModuleList([Down(3), Down(3)])
        self.mid = Mid(3)
        self.up = nn.ModuleList([Up(3), Up(3)])
        self.head = UNetHead()

    def pipeline_layers(self):
        return [self.stem, *self.down, self.mid, *self.up, self.head]

    def forward(self, x):
        out = x
        for layer in self.pipeline_layers():
            out = layer(*out) if isinstance(out, tuple) else layer(out)
        return out

    def pipeline_loss(self, output, batch):
        return F.mse_loss(output, batch[1])

    def training_step(self, batch, batch_idx):
        return self.pipeline_loss(self(batch[0]), batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.5)


def unet_data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 2, 8, generator=g, dtype=torch.float64)
    return TensorDataset(x, x.flip(-1) + 0.1 * torch.randn(SAMPLES, 2, 8, generator=g, dtype=torch.float64))


# -- a diffusion transformer: the class embedding conditions every block -----------------------------
class Embed(nn.Module):
    def __init__(self, dim=4, classes=3):
        super().__init__()
        self.tokens = nn.Linear(3, dim)
        self.label = nn.Embedding(classes, dim)

    def forward(self, x, y):
        return self.tokens(x), self.label(y)


class DiTBlock(nn.Module):
    def __init__(self, dim=4):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.ada = nn.Linear(dim, 3 * dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, c):  # as in the DiT reference code: the block returns x only
        shift, scale, gate = self.ada(F.silu(c)).chunk(3, dim=-1)  # SiLU saves c for its backward
        h = self.norm(x) * (1 + scale[:, None]) + shift[:, None]
        return x + gate[:, None] * self.mlp(h)


class PassCondition(nn.Module):
    """The user's adapter, made in pipeline_layers(): the block's output and the condition, on."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x, c):
        return self.block(x, c), c


class FinalLayer(nn.Module):
    def __init__(self, dim=4):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.ada = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, 3)

    def forward(self, x, c):
        shift, scale = self.ada(F.silu(c)).chunk(2, dim=-1)
        return self.out(self.norm(x) * (1 + scale[:, None]) + shift[:, None])


class DiT(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.embed = Embed()
        self.blocks = nn.ModuleList(DiTBlock() for _ in range(4))
        self.final = FinalLayer()

    def pipeline_layers(self):
        return [self.embed, *(PassCondition(block) for block in self.blocks), self.final]

    def pipeline_inputs(self, batch):
        x, y, _ = batch
        return x, y  # two inputs: the first layer takes them as two arguments

    def forward(self, x, y):
        x, c = self.embed(x, y)
        for block in self.blocks:
            x = block(x, c)
        return self.final(x, c)

    def pipeline_loss(self, output, batch):
        return F.mse_loss(output, batch[2])

    def training_step(self, batch, batch_idx):
        return self.pipeline_loss(self(batch[0], batch[1]), batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def dit_data():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(SAMPLES, 5, 3, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (SAMPLES,), generator=g)
    return TensorDataset(x, y, torch.randn(SAMPLES, 5, 3, generator=g, dtype=torch.float64))


# -- an encoder-decoder: two inputs, a padding mask and integer target ids carried along -------------
class SourceEmbed(nn.Module):
    def __init__(self, dim=4):
        super().__init__()
        self.proj = nn.Linear(3, dim)

    def forward(self, src, tgt_ids, mask):
        return self.proj(src) * mask[..., None], tgt_ids, mask


class EncoderBlock(nn.Module):
    def __init__(self, dim=4):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Linear(dim, dim)

    def forward(self, h, tgt_ids, mask):
        return h + torch.tanh(self.mlp(self.norm(h))) * mask[..., None], tgt_ids, mask


class TargetEmbed(nn.Module):
    def __init__(self, vocab=6, dim=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)

    def forward(self, memory, tgt_ids, mask):
        return self.embed(tgt_ids), memory, mask


class DecoderBlock(nn.Module):
    def __init__(self, dim=4):
        super().__init__()
        self.cross = nn.Linear(dim, dim)
        self.mlp = nn.Linear(dim, dim)

    def forward(self, d, memory, mask):
        pooled = (memory * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
        return d + self.cross(pooled)[:, None] + torch.tanh(self.mlp(d)), memory, mask


class Seq2Seq(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.src_embed = SourceEmbed()
        self.encoder = nn.ModuleList(EncoderBlock() for _ in range(2))
        self.tgt_embed = TargetEmbed()
        self.decoder = nn.ModuleList(DecoderBlock() for _ in range(2))
        self.lm_head = nn.Linear(4, 6)

    def pipeline_layers(self):
        return [self.src_embed, *self.encoder, self.tgt_embed, *self.decoder, LastOfTuple(self.lm_head)]

    def pipeline_inputs(self, batch):
        src, mask, tgt_ids, _ = batch
        return src, tgt_ids, mask

    def forward(self, src, tgt_ids, mask):
        h = self.src_embed(src, tgt_ids, mask)
        for block in self.encoder:
            h = block(*h)
        d = self.tgt_embed(*h)
        for block in self.decoder:
            d = block(*d)
        return self.lm_head(d[0])

    def pipeline_loss(self, logits, batch):
        return F.cross_entropy(logits.flatten(0, 1), batch[3].flatten())

    def training_step(self, batch, batch_idx):
        src, mask, tgt_ids, _ = batch
        return self.pipeline_loss(self(src, tgt_ids, mask), batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class LastOfTuple(nn.Module):
    """The user's adapter for the head: takes the decoder's tuple, keeps the hidden states."""

    def __init__(self, head):
        super().__init__()
        self.head = head

    def forward(self, d, memory, mask):
        return self.head(d)


def seq2seq_data():
    g = torch.Generator().manual_seed(3)
    src = torch.randn(SAMPLES, 5, 3, generator=g, dtype=torch.float64)
    mask = (torch.rand(SAMPLES, 5, generator=g) > 0.3).double()
    mask[:, 0] = 1.0
    tgt = torch.randint(0, 6, (SAMPLES, 4), generator=g)
    return TensorDataset(src, mask, tgt, tgt.roll(1, dims=1))


# -- fan-out and a long residual: a layer's output read by two later layers --------------------------
class Stem2(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 4)

    def forward(self, x):
        e = self.proj(x)
        return torch.tanh(e), e  # e: the residual the last layer adds back


class Gate(nn.Module):
    """Its output is read by the next block and by the one after it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, h, e):
        g = self.lin(h) * e  # the product saves e for its backward, and e is sent on
        return g, g, e


class Mix(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, h, g, e):
        return torch.tanh(self.lin(h)), g, e


class Join(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, h, g, e):
        return self.lin(h) + g, e


class ResidualHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.out = nn.Linear(4, 2)

    def forward(self, h, e):
        return self.out(h + e)


class FanOut(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.stem = Stem2()
        self.gate, self.mix, self.join = Gate(), Mix(), Join()
        self.head = ResidualHead()

    def pipeline_layers(self):
        return [self.stem, self.gate, self.mix, self.join, self.head]

    def forward(self, x):
        return self.head(*self.join(*self.mix(*self.gate(*self.stem(x)))))

    def pipeline_loss(self, output, batch):
        return F.mse_loss(output, batch[1])

    def training_step(self, batch, batch_idx):
        return self.pipeline_loss(self(batch[0]), batch)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.3)


def fanout_data():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(SAMPLES, 3, generator=g, dtype=torch.float64)
    return TensorDataset(x, torch.randn(SAMPLES, 2, generator=g, dtype=torch.float64))


# -- a ViT whose cls_token and pos_embed live on the LightningModule, as timm keeps them -------------
class PatchEmbed(nn.Module):
    """The user's adapter, made in pipeline_layers(), around the root's bare parameters."""

    def __init__(self, proj, cls_token, pos_embed):
        super().__init__()
        self.proj, self.cls_token, self.pos_embed = proj, cls_token, pos_embed

    def forward(self, patches):
        x = self.proj(patches)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return x + self.pos_embed


class ViTBlock(nn.Module):
    def __init__(self, dim=4):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.mlp(self.norm(x)))


class ClsHead(nn.Module):
    def __init__(self, norm, head):
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, x):
        return self.head(self.norm(x)[:, 0])


class ViT(L.LightningModule):
    def __init__(self, dim=4):
        super().__init__()
        self.patch_proj = nn.Linear(6, dim)
        self.cls_token = nn.Parameter(0.1 * torch.randn(1, 1, dim))
        self.pos_embed = nn.Parameter(0.1 * torch.randn(1, 4, dim))
        self.blocks = nn.ModuleList(ViTBlock(dim) for _ in range(3))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 3)

    def pipeline_layers(self):
        return [PatchEmbed(self.patch_proj, self.cls_token, self.pos_embed), *self.blocks,
                ClsHead(self.norm, self.head)]

    def forward(self, patches):
        x = PatchEmbed(self.patch_proj, self.cls_token, self.pos_embed)(patches)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])

    def pipeline_loss(self, logits, batch):
        return F.cross_entropy(logits, batch[1])

    def training_step(self, batch, batch_idx):
        return self.pipeline_loss(self(batch[0]), batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def vit_data():
    g = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(SAMPLES, 3, 6, generator=g, dtype=torch.float64),
                         torch.randint(0, 3, (SAMPLES,), generator=g))


MODELS = {"unet": (UNet, unet_data), "dit": (DiT, dit_data), "seq2seq": (Seq2Seq, seq2seq_data),
          "fanout": (FanOut, fanout_data), "vit": (ViT, vit_data)}


# -- one device, and the pipeline ------------------------------------------------------------------
def _make(name):
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = MODELS[name][0]()
    return model.double()


def _one_device(name, dp=1):
    """One device seeing what the pipeline's data-parallel replicas see together: Lightning's
    distributed sampler shuffles with seed 0 under any distributed strategy; with ``dp`` replicas
    each step's batch is the replicas' batches one after the other."""
    data = MODELS[name][1]()
    shards = [list(DistributedSampler(data, num_replicas=dp, rank=r, shuffle=True, seed=0)) for r in range(dp)]
    order = [i for k in range(0, len(shards[0]), BATCH) for shard in shards for i in shard[k:k + BATCH]]
    model = _make(name)
    initial = {n: p.detach().clone() for n, p in model.state_dict().items()}
    L.Trainer(devices=1, **TRAINER).fit(model, DataLoader(Subset(data, order), batch_size=BATCH * dp))
    return initial, {n: p.detach().clone() for n, p in model.state_dict().items()}


def _fit(rank, world, names, schedules, pp, checkpoint_root):
    from lightning_pp import PipelineStrategy

    os.environ["LOCAL_RANK"] = str(rank)
    results = {}
    for name in names:
        for schedule, vp in schedules:
            model = _make(name)
            strategy = PipelineStrategy(pipeline_parallel_size=pp, virtual_pipeline_size=vp,
                                        schedule=schedule.split("+")[0], num_microbatches=4,
                                        activation_checkpointing=schedule.endswith("+checkpointing"))
            trainer = L.Trainer(devices=world, strategy=strategy, **TRAINER)
            trainer.fit(model, DataLoader(MODELS[name][1](), batch_size=BATCH))  # the user's own loader
            trainer.save_checkpoint(os.path.join(checkpoint_root, f"{name}-{schedule}"))
            results[(name, schedule)] = {n: p.detach().clone() for n, p in model.state_dict().items()}
    return results


def _assert_matches(held, reference, initial, what):
    """Equal to one device within 1e-9 of the update's size."""
    for key, value in held.items():
        update = (reference[key] - initial[key]).abs().max().item()
        error = (value - reference[key]).abs().max().item()
        assert error <= 1e-9 * max(update, 1e-12), f"{what}: {key} differs by {error:.3e} (update {update:.3e})"


def _consolidated(directory):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = directory + ".pt"
    dcp_to_torch_save(directory, out)
    return torch.load(out, weights_only=False)["model"]


def _check(names, schedules, per_rank, checkpoint_root, dp=1):
    for name in names:
        initial, reference = _one_device(name, dp)
        for schedule, _ in schedules:
            held = [r[(name, schedule)] for r in per_rank]
            union = set().union(*held)
            assert union == set(reference), (name, schedule, union ^ set(reference))
            for rank, state in enumerate(held):
                _assert_matches(state, reference, initial, f"{name} under {schedule}, rank {rank}")
            saved = _consolidated(os.path.join(checkpoint_root, f"{name}-{schedule}"))
            assert set(saved) == set(reference), (name, schedule, set(saved) ^ set(reference))
            _assert_matches(saved, reference, initial, f"{name} under {schedule}, consolidated checkpoint")
            if name == "vit":  # the stage holding the patch embedding holds the root's bare parameters, alone
                owners = [rank for rank, state in enumerate(held) if "cls_token" in state]
                assert len(owners) == dp and all("patch_proj.weight" in held[r] for r in owners), (schedule, owners)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("names", [("unet", "dit"), ("seq2seq", "fanout", "vit")])
def test_non_chain_models_equal_one_device_under_every_schedule(names, tmp_path):
    schedules = SCHEDULES + [CHECKPOINTED]
    per_rank = run_distributed(_fit, 2, names, schedules, 2, str(tmp_path), timeout=380)
    _check(names, schedules, per_rank, str(tmp_path))


@pytest.mark.timeout(300)
def test_non_chain_models_with_data_parallel_replicas(tmp_path):
    names, schedules = ("unet", "dit", "vit"), [("zbv", 2)]
    per_rank = run_distributed(_fit, 4, names, schedules, 2, str(tmp_path), timeout=280)
    _check(names, schedules, per_rank, str(tmp_path), dp=2)

"""litdata's streaming loader, made in ``train_dataloader()`` as litgpt makes it, under the pipeline:
every stage of a pipeline reads the same stream, replicas read disjoint shards that together are
the whole set, and training equals one device fed the same stream order (Trainer and Fabric)."""

from __future__ import annotations

import os

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from distributed import run_distributed
from models import Block

litdata = pytest.importorskip("litdata")

SAMPLES, BATCH = 64, 8
TRAINER = dict(accelerator="cpu", max_epochs=1, precision="64-true", logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)


def _sample(index):
    g = torch.Generator().manual_seed(index)
    return {"index": index, "x": torch.randn(5, generator=g), "y": torch.randn(3, generator=g)}


@pytest.fixture(scope="module")
def stream_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("stream") / "optimized"
    litdata.optimize(fn=_sample, inputs=list(range(SAMPLES)), output_dir=str(out), chunk_size=8, num_workers=1)
    return str(out)


class StreamingRegressor(L.LightningModule):
    """Reads a litdata stream in its own train_dataloader(); notes the samples each step trained on."""

    def __init__(self, input_dir: str, num_workers: int = 0):
        super().__init__()
        torch.manual_seed(9)
        self.input_dir, self.num_workers = input_dir, num_workers
        self.embed = nn.Linear(5, 8)
        self.blocks = nn.ModuleList(Block(8) for _ in range(2))
        self.head = nn.Linear(8, 3)
        self.seen: list[list[int]] = []

    def train_dataloader(self):
        from litdata import StreamingDataLoader, StreamingDataset

        return StreamingDataLoader(StreamingDataset(self.input_dir, shuffle=True), batch_size=BATCH,
                                   num_workers=self.num_workers)

    def pipeline_layers(self):
        return [self.embed, *self.blocks, self.head]

    def pipeline_inputs(self, batch):
        return batch["x"]

    def forward(self, x):
        for layer in self.pipeline_layers():
            x = layer(x)
        return x

    def pipeline_loss(self, output, batch):
        return F.mse_loss(output, batch["y"])

    def on_train_batch_start(self, batch, batch_idx):
        self.seen.append(batch["index"].tolist())

    def training_step(self, batch, batch_idx):
        x = batch["x"]
        for layer in self.pipeline_layers():
            x = layer(x)
        return self.pipeline_loss(x, batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _params(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _fit(rank, world, input_dir, num_workers):
    from lightning_pp import PipelineStrategy

    os.environ["LOCAL_RANK"] = str(rank)
    model = StreamingRegressor(input_dir, num_workers)
    trainer = L.Trainer(devices=world, strategy=PipelineStrategy(pipeline_parallel_size=2, num_microbatches=2),
                        **TRAINER)
    trainer.fit(model)
    out = {"seen": model.seen, "params": _params(model), "dp_rank": trainer.strategy.data_parallel_rank,
           "dp_size": trainer.strategy.data_parallel_size}
    if world == 2:  # Fabric, on the same stream, one epoch of a hand-written loop
        from lightning_pp import FabricPipelineStrategy

        out["fabric"] = _fabric_epoch(input_dir, FabricPipelineStrategy(pipeline_parallel_size=2, num_microbatches=2))
    return out


def _fabric_epoch(input_dir, strategy=None):
    """One epoch of the user's Fabric loop (``strategy=None``: one device). The pipelined script
    makes its loader first, at the top, before the strategy exists (so litdata sees the whole
    world, and the strategy's setup_dataloaders re-shards it over the data-parallel ranks)."""
    module = StreamingRegressor(input_dir)
    early = module.train_dataloader() if strategy is not None else None
    fabric = L.Fabric(accelerator="cpu", devices=1 if strategy is None else 2, precision="64-true",
                      **({} if strategy is None else {"strategy": strategy}))
    fabric.launch()
    loader = fabric.setup_dataloaders(early if early is not None else module.train_dataloader())
    if strategy is None:
        model, optimizer = fabric.setup(module, torch.optim.AdamW(module.parameters(), lr=1e-2))
    else:
        model = fabric.setup_module(module)
        optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    seen = []
    for batch in loader:
        seen.append(batch["index"].tolist())
        optimizer.zero_grad()
        if strategy is None:
            fabric.backward(module.pipeline_loss(model(batch["x"]), batch))
        else:
            fabric.strategy.pipeline_step(model, batch)
        optimizer.step()
    return {"seen": seen, "params": _params(module)}


def _replica_stream(input_dir, replicas, rank):
    """What litdata gives replica ``rank`` of ``replicas`` data-parallel processes (its own
    sharding, the distributed environment set as litdata's maintainers advise), batch by batch."""
    from litdata import StreamingDataLoader, StreamingDataset
    from litdata.utilities.env import _DistributedEnv

    dataset = StreamingDataset(input_dir, shuffle=True)
    if replicas > 1:
        dataset.distributed_env = _DistributedEnv(replicas, rank, 1)
        dataset.drop_last = True  # litdata's choice in a distributed run
    return list(StreamingDataLoader(dataset, batch_size=BATCH))


def _one_device(input_dir, batches=None):
    model = StreamingRegressor(input_dir)
    trainer = L.Trainer(devices=1, **TRAINER)
    if batches is None:
        trainer.fit(model)  # its own train_dataloader, one process
    else:
        trainer.fit(model, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    return model.seen, _params(model)


def _assert_params(got, expected, what):
    assert set(got) <= set(expected)
    for name, value in got.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-9, atol=1e-12,
                                   msg=lambda m, name=name: f"{what} {name}: {m}")


@pytest.mark.timeout(300)
def test_litdata_pp2_reads_the_whole_stream_on_every_stage_and_equals_one_device(stream_dir):
    seen, params = _one_device(stream_dir)
    fabric_reference = _fabric_epoch(stream_dir)
    assert sorted(i for step in seen for i in step) == list(range(SAMPLES)) and fabric_reference["seen"] == seen
    for rank, out in enumerate(run_distributed(_fit, 2, stream_dir, 0, timeout=260)):
        assert (out["dp_size"], out["dp_rank"]) == (1, 0)
        assert out["seen"] == seen, f"rank {rank}: trained on other samples, or another order, than one device"
        _assert_params(out["params"], params, f"rank {rank} Trainer")
        assert out["fabric"]["seen"] == seen
        # float64 throughout, as the Trainer (Fabric's one-device wrapper would give the loss a
        # float32 copy of the output under 64-true; the pipeline keeps it float64: see fabric.py)
        _assert_params(out["fabric"]["params"], params, f"rank {rank} Fabric")


@pytest.mark.timeout(300)
def test_litdata_pp2_dp2_replicas_read_disjoint_shards_that_make_the_whole_stream(stream_dir):
    streams = [_replica_stream(stream_dir, 2, r) for r in range(2)]
    together = [{key: torch.cat([a[key], b[key]]) for key in a} for a, b in zip(*streams)]
    _, params = _one_device(stream_dir, together)
    per_rank = run_distributed(_fit, 4, stream_dir, 1, timeout=260, daemon=False)  # one loader worker per rank
    by_replica = {}
    for rank, out in enumerate(per_rank):
        assert out["dp_size"] == 2
        by_replica.setdefault(out["dp_rank"], []).append(out["seen"])
        _assert_params(out["params"], params, f"rank {rank}")
    assert sorted(by_replica) == [0, 1]
    for replica, views in by_replica.items():
        assert views[0] == views[1], f"replica {replica}: its two stages read different batches"
        assert views[0] == [b["index"].tolist() for b in streams[replica]]
    everything = [i for views in by_replica.values() for step in views[0] for i in step]
    assert sorted(everything) == list(range(SAMPLES))  # disjoint, and together the whole set

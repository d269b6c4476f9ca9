"""The end of a step: the loss, its normaliser, and what every rank decides from them.

One all-reduce carries the loss sum and count (only last-stage ranks contribute), one inf/nan flag
per pipeline rank and one batch fingerprint per rank: every rank gets them all and decides alike
(raise, skip or ignore a non-finite step; raise or warn when the stages of a pipeline ran
different batches) with no collective of its own.

Loss normalisation: a ``pipeline_loss`` that returns a mean is weighted by its microbatch's sample
count; one that returns ``(loss_sum, count)`` is divided by the global count over all
microbatches and data-parallel ranks. Either way the gradients equal those of the whole batch on
one device.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_pp.runtime.failure.errors import BatchMismatchError
from lightning_pp.runtime.topology import Topology
from lightning_pp.schedules import ScheduleConfig


def normalise_loss(value: Any, samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum, count) from what ``pipeline_loss`` returned."""
    if isinstance(value, (tuple, list)) and len(value) == 2:
        loss_sum, count = value
        if not isinstance(loss_sum, torch.Tensor) or loss_sum.numel() != 1:
            raise ValueError(
                f"pipeline_loss returned a pair whose first item is {type(loss_sum).__name__}"
                f"{'' if not isinstance(loss_sum, torch.Tensor) else ' of shape ' + str(tuple(loss_sum.shape))}: "
                f"it must be a scalar tensor (the loss summed over the microbatch), with the count second."
            )
        count = torch.as_tensor(count, dtype=torch.float64).reshape(())
        return loss_sum.reshape(()), count
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"pipeline_loss returned {shape}: it must return a scalar tensor (the microbatch's mean "
            f"loss) or a (loss_sum, count) pair. Reduce the loss, e.g. with .mean()."
        )
    return value.reshape(()) * samples, torch.tensor(float(samples), dtype=torch.float64)


@dataclass
class StepTotals:
    """What the end-of-step all-reduce decided, the same on every rank."""

    loss: Optional[torch.Tensor] = None  # the batch loss (global weighted mean)
    count: float = 0.0  # the global normaliser
    nonfinite: Optional[str] = None  # what was not finite, or None


class StepEnd:
    """Builds the end-of-step all-reduce and reads the decisions off it."""

    def __init__(self, config: ScheduleConfig, topology: Topology, device: torch.device) -> None:
        self.config, self.topology, self.device = config, topology, device

    def run(self, loss_sum: torch.Tensor, count: torch.Tensor, *, train: bool, compute_loss: bool,
            fingerprint: Optional[torch.Tensor], stage_flags: Callable[[], Sequence[tuple[int, torch.Tensor]]],
            step: int, nonfinite: str, check_batches: str, wait: Callable[[Any, str], None]) -> StepTotals:
        """The all-reduce and its decisions. ``stage_flags()``: (virtual stage, 1.0 where this
        rank's gradients of its parameters hold inf/nan), e.g. ``GradientSync.nonfinite_flags``, asked
        only when the policy checks; ``nonfinite`` and ``check_batches``
        are the policies (see ``PipelineConfig``); ``wait`` the step's bounded wait."""
        if not (train or compute_loss or fingerprint is not None):
            return StepTotals()
        stages, world = self.config.num_stages, self.topology.dims.world_size
        parts = [torch.stack([loss_sum, count])]
        if self.topology.tp_rank != 0:  # a tensor-parallel group's ranks computed the same loss: count it once
            parts = [torch.zeros_like(parts[0])]
        flags = train and nonfinite != "ignore"
        if flags:
            local = torch.zeros(stages, dtype=torch.float64, device=self.device)
            for stage, flag in stage_flags():
                local[stage] = torch.maximum(local[stage], flag.to(local.dtype).reshape(()))
            parts.append(local)
        if fingerprint is not None:
            prints = torch.zeros(world, dtype=torch.float64, device=self.device)
            prints[self.topology.rank] = fingerprint
            parts.append(prints)
        totals = torch.cat(parts)
        wait(dist.all_reduce(totals, async_op=True), "the all-reduce of the step's loss")
        values = totals.tolist()
        if fingerprint is not None:
            self._check_same_batches(values[len(values) - world:], train, step, check_batches)
        if not (train or compute_loss):
            return StepTotals()
        total_count = values[1]
        if total_count <= 0:
            raise ValueError(
                f"the global loss count is {total_count}: pipeline_loss must return a positive count "
                f"(or a mean over a non-empty microbatch)."
            )
        return StepTotals(totals[0] / totals[1], total_count,
                          self._nonfinite_description(values[0], total_count, values[2:2 + stages] if flags else []))

    def _nonfinite_description(self, loss_sum: float, count: float, flags: list[float]) -> Optional[str]:
        """What was not finite; ``flags``: one per virtual stage, in stage order. Ranks are the
        stages' owners under the schedule's placement (a V places rank 0's second chunk last)."""
        loss_bad = not math.isfinite(loss_sum)
        stages = [stage for stage, flag in enumerate(flags) if flag > 0]
        if not loss_bad and not stages:
            return None
        parts = []
        if loss_bad:
            parts.append(f"the batch loss is {loss_sum / count if count else loss_sum}")
        if stages:
            ranks = sorted({self.config.owner_of(stage)[0] for stage in stages})
            parts.append(f"gradients hold inf/nan on pipeline rank(s) {ranks} (virtual stage(s) {stages})")
        return "; ".join(parts)

    def _check_same_batches(self, fingerprints: list[float], train: bool, step: int, policy: str) -> None:
        """Compare every pipeline's stages' batch fingerprints (all ranks see all of them, so they
        all decide alike); raise or warn per ``check_batches``."""
        dims = self.topology.dims
        differing = []
        for dp_rank in range(dims.dp):  # every stage and tensor-parallel rank of a replica reads one batch
            ranks = [dims.rank_of(p, dp_rank, t) for p in range(dims.pp) for t in range(dims.tp)]
            first = fingerprints[ranks[0]]
            odd = [p for p, r in enumerate(ranks) if fingerprints[r] != first]
            if odd:
                differing.append((dp_rank, ranks, odd))
        if not differing:
            return
        where = "; ".join(
            f"data-parallel replica {dp_rank}: pipeline rank(s) {odd} (global rank(s) {[ranks[p] for p in odd]}) "
            f"got a different batch than pipeline rank 0 (global rank {ranks[0]})"
            for dp_rank, ranks, odd in differing[:4]
        )
        what = f"training step {step}" if train else "an evaluation/prediction step"
        message = (
            f"{what}: the stages of a pipeline were given different batches ({where}). Stage 0 reads the "
            f"inputs and the last stage the targets of its own copy of the batch, so this trains on inputs "
            f"paired with other samples' targets. Likely causes: randomness that is not seeded alike on every "
            f"rank (an unseeded `random`/NumPy transform in a Dataset, DataLoader workers seeded per rank, "
            f"e.g. by seed_everything(workers=True), shuffle=True without a common seed), or a sampler that "
            f"depends on the global rank (with Lightning keep use_distributed_sampler=True: the strategy "
            f"shards over data-parallel ranks only), or a dataset that shards itself by torch.distributed's "
            f"global rank and world size (an IterableDataset such as webdataset's; litdata's StreamingDataset "
            f"is sharded over the data-parallel ranks by the strategies). Fixes: seed the data pipeline "
            f"identically on the ranks of a pipeline; shard a self-sharding dataset by strategy.data_parallel_rank "
            f"and strategy.data_parallel_size; or check_batches='off' if the difference is intended. "
            f"broadcast_batches=True uses pipeline rank 0's batch on every stage: it fixes randomness, but with a "
            f"dataset that shards itself by global rank it trains on stage 0's shard only and never reads the "
            f"other stages' (an epoch of fewer samples)."
        )
        if policy == "raise":
            raise BatchMismatchError(message)
        warnings.warn(message, stacklevel=3)

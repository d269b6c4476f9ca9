"""A random stream per virtual stage, so dropout masks do not repeat across stages.

With one seed on every rank (``seed_everything``), every rank's default generator starts in the
same state; the first dropout on pipeline stage 1 would then draw exactly the mask stage 0 drew.
On one device they come from one stream, one after the other. So, as Megatron's model-parallel
RNG tracker does, every (virtual stage, data-parallel rank) pair gets its own generator state,
derived from the seed the default generator had when the pipeline was built and from the pair,
and each chunk's forward runs with its state swapped in (the default generator's own state is put
back afterwards, so data loading and user code are unaffected). Expert-parallel ranks are
data-parallel ranks, so each expert rank has its own stream too.

Reproducible: two launches with one seed draw the same masks. Activation recomputation replays
them: ``torch.utils.checkpoint`` saves the generator state current at the forward (the chunk's)
and restores it for the recomputation. The streams are not saved in checkpoints (Lightning does
not save generator states either); a resumed run draws new masks.
"""

from __future__ import annotations

import hashlib
from contextlib import contextmanager
from typing import Iterator, Optional

import torch


def stream_seed(base_seed: int, stage: int, dp_rank: int) -> int:
    """The seed of one (virtual stage, data-parallel rank) stream: a hash, so streams never
    coincide with each other or with small user seeds."""
    digest = hashlib.blake2b(f"lightning_pp/{base_seed}/{stage}/{dp_rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class StageRNG:
    """The generator states of this rank's chunks; :meth:`stream` runs code in one of them."""

    def __init__(self, stages: list[int], dp_rank: int, device: torch.device, base_seed: Optional[int] = None) -> None:
        self.base_seed = torch.initial_seed() if base_seed is None else base_seed
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.device = device
        self.cpu_states: list[torch.Tensor] = []
        self.cuda_states: list[Optional[torch.Tensor]] = []
        for stage in stages:
            seed = stream_seed(self.base_seed, stage, dp_rank)
            self.cpu_states.append(torch.Generator().manual_seed(seed).get_state())
            self.cuda_states.append(self._cuda_state_for(seed) if self.cuda else None)

    def _cuda_state_for(self, seed: int) -> torch.Tensor:
        saved = torch.cuda.get_rng_state(self.device)
        try:
            torch.cuda.manual_seed(seed)
            return torch.cuda.get_rng_state(self.device)
        finally:
            torch.cuda.set_rng_state(saved, self.device)

    @contextmanager
    def stream(self, chunk_id: int) -> Iterator[None]:
        """Run the body with chunk ``chunk_id``'s generator state; keep where it got to."""
        cpu_saved = torch.get_rng_state()
        torch.set_rng_state(self.cpu_states[chunk_id])
        cuda_saved = None
        if self.cuda:
            cuda_saved = torch.cuda.get_rng_state(self.device)
            torch.cuda.set_rng_state(self.cuda_states[chunk_id], self.device)
        try:
            yield
        finally:
            self.cpu_states[chunk_id] = torch.get_rng_state()
            torch.set_rng_state(cpu_saved)
            if self.cuda:
                self.cuda_states[chunk_id] = torch.cuda.get_rng_state(self.device)
                torch.cuda.set_rng_state(cuda_saved, self.device)

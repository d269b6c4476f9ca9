"""What travels between an expert-parallel layer's slots: what ``moe_pre`` returns
(:class:`MoERouting`) and what one microbatch's pass carries from the routing to the combine
(:class:`DispatchState`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch

from lightning_pp.runtime.plans.plan import PlanEvent


class MoERouting(NamedTuple):
    """What a layer's ``moe_pre`` returns."""

    carry: tuple  # tensors handed unchanged to moe_post (through every node)
    tokens: torch.Tensor  # [T, C] the rows to route
    probs: torch.Tensor  # [T, k] the weight of each chosen expert's output
    indices: torch.Tensor  # [T, k] the chosen experts


@dataclass
class DispatchState:
    """What one microbatch's pass through the layer carries from slot to slot (routing, the
    all-to-all splits, the staging slot), made by ``_route`` and read by the later slots."""

    num_tokens: int = 0  # tokens routed
    token_of: Optional[torch.Tensor] = None  # [rows] the token each expert-ordered row belongs to
    counts: Optional[torch.Tensor] = None  # [num_experts] rows this rank sends to each expert
    capacity: Optional[int] = None  # rows per expert and rank (None: dropless)
    counts_exchange: Optional[tuple] = None  # (received counts, work) while the exchange is in flight
    send_splits: list = field(default_factory=list)  # rows sent to each expert-parallel rank
    recv_splits: list = field(default_factory=list)  # rows received from each
    expert_major: Optional[torch.Tensor] = None  # source-major row of each expert-major row
    expert_counts: list = field(default_factory=list)  # rows each local expert gets
    slot: Optional[int] = None  # the staging pool's slot (None without staging)
    event: Optional[PlanEvent] = None  # the microbatch's event (fine-grained execution)

"""litgpt's rotary cache as the pipeline's block layers read it (shared by the dense and the MoE
block layers, so neither module imports the other for it)."""

from __future__ import annotations

import torch
from litgpt.model import GPT


class Rope:
    """The model's rotary cache, read by every block layer. Not a module: the layers must not own
    the model (its cache buffers move and are rebuilt with it)."""

    def __init__(self, gpt: GPT) -> None:
        self.gpt = gpt

    def check_length(self, length: int) -> None:
        if length > self.gpt.max_seq_length:
            raise ValueError(
                f"Cannot forward sequence of length {length}, max seq length is only {self.gpt.max_seq_length}."
            )

    def cos_sin(self, length: int, block_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.gpt.cos[:length].unsqueeze(0), self.gpt.sin[:length].unsqueeze(0)
        indices = self.gpt.config.rope_indices
        if indices is not None:  # Gemma 3: local or global rotary frequencies per layer
            cos, sin = cos[..., indices[block_idx]], sin[..., indices[block_idx]]
        return cos, sin

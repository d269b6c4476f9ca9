"""litgpt's ``GPT`` pipelined as it is: its own modules, its parameter names, its maths.

litgpt (Lightning AI's LLM library) builds every architecture it supports (GPT-NeoX/pythia,
Llama 2/3, Mistral, Gemma 1/2/3, Phi, Qwen, the Mixtral and Qwen3 mixtures of experts, ...) from
one ``GPT`` of ``Block`` modules driven by a ``Config``. This module cuts that model without
rewriting it::

    from litgpt import GPT, Config
    from lightning_pp.integrations import litgpt as lpp_litgpt

    class MyLLM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = GPT(Config.from_name("pythia-14m"))   # kept where users keep it

        def pipeline_layers(self):
            return lpp_litgpt.pipeline_layers(self.model)        # embedding, every block, head

        def pipeline_inputs(self, batch):
            return lpp_litgpt.pipeline_inputs(batch)

        def pipeline_loss(self, logits, batch):
            return lpp_litgpt.pipeline_loss(logits, batch)       # litgpt's token cross-entropy

The layers are small adapters around the model's own modules (``transformer.wte``,
``transformer.h[i]``, ``transformer.ln_f``, ``lm_head``), so the cut removes from ``self.model``
whatever another rank holds and every name stays litgpt's (``model.transformer.h.3.attn.qkv.weight``):
litgpt checkpoints (``lit_model.pth``) load into a pipelined model with ``load_state_dict`` and
back without a key map. Each stage computes what a block needs (rotary cos/sin, Gemma 3's
per-layer choice of them, masks) from the model's own caches instead of sending it.

:class:`LitGPT` is a ready LightningModule (built on the meta device, so no rank holds the whole
model), configurable from LightningCLI by litgpt config name.

Not supported through the pipeline: litgpt's KV cache (``set_kv_cache``, generation with
``input_pos``) and ``lm_head_chunk_size``; generate with the full model, or run prefix forwards
through ``strategy.pipeline_predict``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn


try:
    from litgpt.config import Config
    from litgpt.model import GPT, do_softcapping
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "lightning_pp.integrations.litgpt needs litgpt: pip install 'lightning_pp[litgpt]' (or pip install litgpt)."
    ) from error

from lightning_pp.integrations.litgpt_moe import MoEBlockLayer, is_moe_block
from lightning_pp.integrations.litgpt_rope import Rope
from lightning_pp.runtime.cut.meta import materialize

IGNORE_INDEX = -100  # litgpt's: targets with this value (prompt and padding tokens) are not scored


class Embedding(nn.Module):
    """Token embedding (scaled by sqrt(n_embd) where the config says so, as Gemma's)."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.wte = gpt.transformer.wte
        self.scale = gpt.config.n_embd ** 0.5 if gpt.config.scale_embeddings else None
        self.rope = Rope(gpt)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.rope.check_length(idx.size(1))
        x = self.wte(idx)
        if self.scale is not None:
            x = x * torch.tensor(self.scale, dtype=x.dtype)
        return x


class BlockLayer(nn.Module):
    """One litgpt ``Block``, called as ``GPT.forward`` calls it in training (no KV cache)."""

    def __init__(self, gpt: GPT, block_idx: int) -> None:
        super().__init__()
        self.block = gpt.transformer.h[block_idx]
        self.block_idx = block_idx
        self.rope = Rope(gpt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope.cos_sin(x.size(1), self.block_idx)
        return self.block(x, cos, sin)


class Head(nn.Module):
    """Final norm and output projection (with the final logit softcapping where configured)."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.ln_f = gpt.transformer.ln_f
        self.lm_head = gpt.lm_head
        self.softcapping = gpt.config.final_logit_softcapping

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.ln_f(x))
        if self.softcapping is not None:
            logits = do_softcapping(logits, thresh=self.softcapping)
        return logits


def pipeline_layers(gpt: GPT) -> list[nn.Module]:
    """The layers of a litgpt ``GPT``: the embedding, every block, the head. Adapters over the
    model's own modules, made anew on each call (the pipeline calls it once). A block whose MLP is
    a mixture of experts (``LLaMAMoE``) gets a :class:`~lightning_pp.integrations.litgpt_moe.MoEBlockLayer`,
    which runs its experts expert-parallel (``expert_parallel_size``) with litgpt's routing."""

    if not isinstance(gpt, GPT):
        raise TypeError(f"pipeline_layers expects a litgpt GPT, got {type(gpt).__name__}.")
    if gpt.mask_cache is not None or any(block.attn.kv_cache is not None for block in gpt.transformer.h):
        raise ValueError(
            "the GPT has a KV cache (set_kv_cache): generation with a KV cache cannot run through the pipeline. "
            "Call gpt.clear_kv_cache() before training it pipelined."
        )
    blocks = [MoEBlockLayer(gpt, i) if is_moe_block(block) else BlockLayer(gpt, i)
              for i, block in enumerate(gpt.transformer.h)]
    return [Embedding(gpt), *blocks, Head(gpt)]


def _split(batch: Any) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(inputs, targets, whether the logits must be shifted) for litgpt's batch forms."""
    if isinstance(batch, dict):
        if "input_ids" not in batch or "labels" not in batch:
            raise KeyError(f"a litgpt batch dict holds 'input_ids' and 'labels'; this one holds {sorted(batch)}.")
        return batch["input_ids"], batch["labels"], True  # fine-tuning data: output n predicts label n+1
    if isinstance(batch, torch.Tensor):
        return batch[:, :-1], batch[:, 1:], False  # pretraining data: one sequence of T + 1 tokens
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1], False
    raise TypeError(
        f"unsupported litgpt batch of type {type(batch).__name__}: pass a tensor of T + 1 tokens per sample "
        f"(pretraining), a dict with 'input_ids' and 'labels' (fine-tuning), or an (inputs, targets) pair."
    )


def pipeline_inputs(batch: Any) -> torch.Tensor:
    """The token ids the embedding reads, for every batch form :func:`pipeline_loss` takes."""
    return _split(batch)[0]


def pipeline_loss(logits: torch.Tensor, batch: Any, ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, torch.Tensor]:
    """litgpt's token cross-entropy (``chunked_cross_entropy``: the mean over the tokens whose target
    is not ``ignore_index``), as a ``(loss_sum, token_count)`` pair so that the pipeline divides by
    the token count of the whole batch, exactly as one device does."""
    _, targets, shift = _split(batch)
    if shift:
        logits, targets = logits[..., :-1, :], targets[..., 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=ignore_index,
                           reduction="sum")
    return loss, (targets != ignore_index).sum()


def init_weights(gpt: GPT, module: nn.Module) -> None:
    """litgpt's initialisation of one module (``GPT._init_weights``), after the module's own
    ``reset_parameters`` (norms, the rotary cache). What :func:`lightning_pp.runtime.materialize`
    calls for every module it gives memory."""
    gpt._init_weights(module)


def load_checkpoint(gpt: GPT, path: Union[str, Path]) -> None:
    """Load a litgpt checkpoint (``lit_model.pth``, a ``GPT.state_dict()``) into ``gpt``, whole or
    cut: the file is memory-mapped and only this rank's tensors are read, so no rank holds the
    whole model."""
    state = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    gpt.load_state_dict(state.get("model", state))  # litgpt's own files hold the state dict, some {"model": ...}


class LitGPT(L.LightningModule):
    """litgpt's GPT as a LightningModule, for the pipeline strategies (and any other).

    Args:
    name: a litgpt config name (``Config.from_name``), e.g. ``"pythia-14m"``.
    config: overrides of that config, e.g. ``{"n_layer": 4}``.
    learning_rate, weight_decay, betas: AdamW's (weight decay on matrices only).
    warmup_steps: linear learning-rate warm-up.
    checkpoint: a litgpt checkpoint (``lit_model.pth``) to start from; memory-mapped, each
        rank reads only its own weights.

    The model is built on the meta device in ``configure_model``; a pipeline strategy
    materialises on each rank only the layers it keeps, initialised by litgpt's
    ``_init_weights`` with a seed per module (``lightning_pp.runtime.cut.meta``), and any other
    strategy materialises the whole model the same way, so both start from the same weights.
    """

    def __init__(self, name: str = "pythia-14m", config: Optional[dict] = None, learning_rate: float = 3e-4,
                 weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95), warmup_steps: int = 0,
                 checkpoint: Optional[str] = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.config = Config.from_name(name, **(config or {}))
        self.model: Optional[GPT] = None
        self._checkpoint_loaded = checkpoint is None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        with torch.device("meta"):
            self.model = GPT(self.config)
        strategy = self.trainer.strategy if self._trainer is not None else None
        if not getattr(strategy, "materializes_meta_modules", False):
            device = strategy.root_device if strategy is not None else torch.device("cpu")
            # The whole module, as the pipeline materialises it (the seeds follow the names from here).
            materialize(self, device, torch.initial_seed(), self.pipeline_init_weights)

    def _load_checkpoint(self) -> None:
        if not self._checkpoint_loaded:
            load_checkpoint(self.model, self.hparams.checkpoint)
            self._checkpoint_loaded = True

    def on_fit_start(self) -> None:
        self._load_checkpoint()

    on_validation_start = on_test_start = on_predict_start = on_fit_start

    # -- the pipeline protocol ------------------------------------------------------------
    def pipeline_layers(self) -> list[nn.Module]:
        return pipeline_layers(self.model)

    def pipeline_inputs(self, batch: Any) -> torch.Tensor:
        return pipeline_inputs(batch)

    def pipeline_loss(self, logits: torch.Tensor, batch: Any):
        return pipeline_loss(logits, batch)

    def pipeline_init_weights(self, module: nn.Module) -> None:
        init_weights(self.model, module)

    # -- one device (any other strategy) --------------------------------------------------
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _step_loss(self, batch: Any) -> torch.Tensor:
        loss_sum, count = pipeline_loss(self(pipeline_inputs(batch)), batch)
        return loss_sum / count

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._step_loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._step_loss(batch), prog_bar=True)

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.hparams.weight_decay},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.learning_rate, betas=tuple(self.hparams.betas))
        warmup = max(1, self.hparams.warmup_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


__all__ = ["BlockLayer", "Embedding", "Head", "IGNORE_INDEX", "LitGPT", "init_weights", "load_checkpoint",
           "pipeline_inputs", "pipeline_layers", "pipeline_loss"]

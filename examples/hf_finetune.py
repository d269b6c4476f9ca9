"""Fine-tune a Hugging Face transformers model under the pipeline from a local checkpoint, with
LightningCLI, and write the result back in HF's format.

    python examples/hf_finetune.py fit --config examples/hf.yaml
    python examples/hf_finetune.py fit --config examples/hf_moe.yaml   # Qwen3-MoE, pp=2 x ep=2, combined 1F1B

The model is transformers' own (``AutoModelForCausalLM`` from the checkpoint's config), wrapped by
``lightning_pp.integrations.hf.LitHF``: built on the meta device, each pipeline rank materialises
only its own layers, then reads only its own tensors of the checkpoint's safetensors files. Nothing
is downloaded: if the checkpoint directory is missing, this script first makes one on one device
(a tiny Llama, pretrained shortly on the first half of the Python standard library's source, bytes
as tokens, written with ``save_pretrained``); the fine-tuning data is the other half. It prints the
validation loss before and after fine-tuning, then writes the fine-tuned model with
``LitHF.save_hf`` and reloads it with ``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import torch
import yaml
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, Dataset

import lightning_pp  # noqa: F401  (registers pp_1f1b & co.)
from lightning_pp.integrations.hf import LitHF
from train_moe_gpt import Windows, stdlib_bytes  # the two halves of the corpus (examples/ is on sys.path when run)


class TokenDicts(Dataset):
    """Byte windows as HF batches: ``{"input_ids": window}`` (labels are the inputs, shifted by the loss)."""

    def __init__(self, data: bytes, context: int, length: int, seed: int):
        self.windows = Windows(data, context, length, seed)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int):
        x, y = self.windows[index]
        return {"input_ids": torch.cat([x, y[-1:]])}


class StdlibTokens(L.LightningDataModule):
    def __init__(self, context: int = 64, batch_size: int = 8, part: int = 1, train_windows: int = 2048,
                 val_windows: int = 64) -> None:
        super().__init__()
        data = stdlib_bytes(part)
        cut = len(data) * 9 // 10
        self.train_set = TokenDicts(data[:cut], context, train_windows, seed=1)
        self.val_set = TokenDicts(data[cut:], context, val_windows, seed=2)
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)


TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)
FAMILIES = {"llama": TINY,  # the "pretrained" models the example makes, by the YAML's model_type
            "qwen3_moe": dict(TINY, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)}


def make_checkpoint(path: Path, data_args: dict, steps: int = 40, model_type: str = "llama") -> None:
    """The "pretrained" checkpoint, on one device: a tiny model of ``model_type`` (a Llama, or a
    Qwen3-MoE for examples/hf_moe.yaml), a short pretraining on the other half of the corpus,
    written with ``save_pretrained``."""
    print(f"making the HF checkpoint {path} ({model_type}) on one device ({steps} steps)", flush=True)
    torch.manual_seed(0)
    model = LitHF(model_type=model_type, config=FAMILIES[model_type], optimizer_args={"lr": 3e-3})
    data = StdlibTokens(**{**data_args, "part": 0})
    L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0).fit(model, data)
    model.save_hf(path)


class CLI(LightningCLI):
    def before_fit(self) -> None:
        (before,) = self.trainer.validate(self.model, self.datamodule, verbose=False)
        self._before = before["val_loss"]

    def after_fit(self) -> None:
        (after,) = self.trainer.validate(self.model, self.datamodule, verbose=False)
        out = Path(self.model.hparams.checkpoint).with_name("finetuned")
        self.model.save_hf(out)  # every rank: the tensors are gathered on rank 0
        if self.trainer.is_global_zero:
            from transformers import AutoModelForCausalLM

            AutoModelForCausalLM.from_pretrained(str(out))
            print(f"validation loss (nats/byte): {self._before:.3f} from the checkpoint, {after['val_loss']:.3f} "
                  f"after fine-tuning; saved in HF's format to {out}", flush=True)


def main(args=None):
    argv = sys.argv[1:] if args is None else args
    if "--config" in argv and "LOCAL_RANK" not in os.environ:  # the launching process, before any rank
        config = yaml.safe_load(open(argv[argv.index("--config") + 1]))
        checkpoint = config["model"]["init_args"]["checkpoint"]
        model_type = config["model"]["init_args"].get("model_type") or "llama"
        for arg in argv:  # a checkpoint path given on the command line
            if arg.startswith("--model.init_args.checkpoint="):
                checkpoint = arg.split("=", 1)[1]
        if not Path(checkpoint).exists():
            make_checkpoint(Path(checkpoint), config.get("data", {}), model_type=model_type)
    torch.set_num_threads(1)
    return CLI(LitHF, StdlibTokens, subclass_mode_model=True, args=args, save_config_callback=None)


if __name__ == "__main__":
    main()

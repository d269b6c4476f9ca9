"""Fine-tune a litgpt model under the pipeline from a local litgpt checkpoint, with LightningCLI.

    python examples/litgpt_finetune.py fit --config examples/litgpt.yaml

The model is litgpt's own ``GPT`` (``model.init_args.name`` is any litgpt config name, plus
``config`` overrides), wrapped by ``lightning_pp.integrations.litgpt.LitGPT``: built on the meta
device, each pipeline rank materialises only its own layers, then reads only its own weights of
the checkpoint (memory-mapped). Nothing is downloaded: if the checkpoint is missing, this script
first makes one on one device (a short pretraining on the first half of the Python standard
library's source, bytes as tokens, saved as litgpt does: ``lit_model.pth`` and
``model_config.yaml``); the fine-tuning data is the other half. It prints the validation loss
before and after fine-tuning.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import torch
import yaml
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader

import lightning_pp  # noqa: F401  (registers pp_1f1b & co.)
from lightning_pp.integrations.litgpt import LitGPT
from train_moe_gpt import Windows, stdlib_bytes  # byte windows of a corpus (examples/ is on sys.path when run)


class StdlibText(L.LightningDataModule):
    def __init__(self, context: int = 64, batch_size: int = 8, part: int = 1, train_windows: int = 4096,
                 val_windows: int = 64) -> None:
        super().__init__()
        data = stdlib_bytes(part)
        cut = len(data) * 9 // 10
        self.train_set = Windows(data[:cut], context, train_windows, seed=1)
        self.val_set = Windows(data[cut:], context, val_windows, seed=2)
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)


def make_checkpoint(model_args: dict, data_args: dict, steps: int = 60) -> None:
    """The "pretrained" litgpt checkpoint, on one device: a short pretraining on the other half of
    the corpus, saved in litgpt's format."""
    from litgpt.utils import save_config

    path = Path(model_args["checkpoint"])
    print(f"making the litgpt checkpoint {path} on one device ({steps} steps)", flush=True)
    torch.manual_seed(0)
    model = LitGPT(**{**model_args, "checkpoint": None})
    data = StdlibText(**{**data_args, "part": 0})
    L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0).fit(model, data)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.model.state_dict(), path)
    save_config(model.config, path.parent)


class CLI(LightningCLI):
    def before_fit(self) -> None:
        (before,) = self.trainer.validate(self.model, self.datamodule, verbose=False)
        self._before = before["val_loss"]

    def after_fit(self) -> None:
        (after,) = self.trainer.validate(self.model, self.datamodule, verbose=False)
        if self.trainer.is_global_zero:
            print(f"validation loss (nats/byte): {self._before:.3f} from the checkpoint, {after['val_loss']:.3f} "
                  f"after fine-tuning", flush=True)


def main(args=None):
    argv = sys.argv[1:] if args is None else args
    if "--config" in argv and "LOCAL_RANK" not in os.environ:  # the launching process, before any rank
        config = yaml.safe_load(open(argv[argv.index("--config") + 1]))
        model_args = config["model"]["init_args"]
        for arg in argv:  # a checkpoint path given on the command line
            if arg.startswith("--model.init_args.checkpoint="):
                model_args["checkpoint"] = arg.split("=", 1)[1]
        if model_args.get("checkpoint") and not Path(model_args["checkpoint"]).exists():
            make_checkpoint(model_args, config.get("data", {}))
    torch.set_num_threads(1)
    return CLI(LitGPT, StdlibText, subclass_mode_model=True, args=args, save_config_callback=None)


if __name__ == "__main__":
    main()

"""Host memory per rank when a local Hugging Face checkpoint is loaded into a pipelined model
(issue 22), measured as ``bench_meta_init.py`` measures litgpt's:

Model: a transformers Llama (``--layers`` decoder layers of width ``--width``, ``--vocab`` tokens,
untied, float32) written once with ``save_pretrained`` (safetensors, sharded at 200 MB into an
index) by the launching process; ``--ranks`` gloo processes, one pipeline stage each, the same
number of decoder layers per stage (the embedding on the first, norm and head on the last). Per
rank, after ``import torch`` and the process group, the kernel's peak-RSS counter is reset, then

* ``from_pretrained``: what a user does without the integration: every rank calls
  ``AutoModelForCausalLM.from_pretrained`` (the whole model), then ``build_pipeline`` cuts it;
* ``meta+load``: the model built from the checkpoint's config on the meta device, cut by
  ``build_pipeline`` (materialising only this rank's layers), then
  ``lightning_pp.integrations.hf.load_pretrained``: each rank reads only its own tensors.

Each in fresh processes. The figure is the peak RSS the path added over the rank's share (bytes of
the parameters it holds after the cut), and what stays added at the end.

    python benchmarks/bench_hf_load.py              # 8 ranks, 16 layers of 1024: 752 MB of weights
    python benchmarks/bench_hf_load.py --quick
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_meta_init import _rss_kb, model_size_main, share_figures  # noqa: E402
from common import launch  # noqa: E402

PATHS = ("from_pretrained", "meta+load")


def _config(args):
    import transformers

    return transformers.LlamaConfig(hidden_size=args.width, intermediate_size=int(2.75 * args.width),
                                    num_hidden_layers=args.layers, num_attention_heads=max(1, args.width // 64),
                                    num_key_value_heads=max(1, args.width // 128), vocab_size=args.vocab,
                                    tie_word_embeddings=False, max_position_embeddings=256)


def _measure(rank, world, args, path, checkpoint):
    import torch
    import transformers
    from torch import nn

    from lightning_pp.integrations import hf
    from lightning_pp.runtime import build_pipeline

    class Holder(nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def pipeline_layers(self):
            return hf.pipeline_layers(self.model)

        def pipeline_loss(self, logits, batch):
            return hf.pipeline_loss(logits, batch)

        def pipeline_init_weights(self, module):
            hf.init_weights(self.model, module)

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS counter
    before = _rss_kb("VmRSS")
    torch.manual_seed(0)
    if path == "from_pretrained":
        holder = Holder(transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32))
    else:
        config = transformers.AutoConfig.from_pretrained(checkpoint)
        with torch.device("meta"):
            holder = Holder(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    per = args.layers // world
    layout = [per + (r == 0) + (r == world - 1) for r in range(world)]  # the embedding; norm + head
    executor = build_pipeline(holder, pipeline_parallel_size=world, num_microbatches=world, watchdog=False,
                              layout=layout)
    read = hf.load_pretrained(holder.model, checkpoint) if path == "meta+load" else {"bytes": 0}
    share = sum(p.numel() * p.element_size() for p in holder.parameters())
    peak, end = _rss_kb("VmHWM") - before, _rss_kb("VmRSS") - before
    executor.close()
    return {"share_mb": share / 2**20, "peak_mb": peak / 1024, "end_mb": end / 1024, "read_mb": read["bytes"] / 2**20}


def run(args) -> dict:
    import torch
    import transformers

    torch.manual_seed(0)
    whole = transformers.AutoModelForCausalLM.from_config(_config(args), dtype=torch.float32)
    total = sum(p.numel() * p.element_size() for p in whole.parameters())
    with tempfile.TemporaryDirectory() as tmp:
        whole.save_pretrained(tmp, max_shard_size="200MB")
        del whole
        results = {path: launch(_measure, args.ranks, args, path, tmp, timeout=900) for path in PATHS}
    figures = {"hf_full_model_mb": total / 2**20}
    for path, per_rank in results.items():
        figures.update(share_figures("hf_" + path.replace("+", "_"), per_rank))
    figures["hf_read_over_share_max"] = max(r["read_mb"] / r["share_mb"] for r in results["meta+load"])
    return figures


def main(argv=None) -> dict:
    return model_size_main(__doc__, run, argv)


if __name__ == "__main__":
    main()

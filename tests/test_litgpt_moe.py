"""litgpt's mixture-of-experts families expert-parallel: tiny Mixtral and Qwen3-MoE at pp=2 x ep=2
(4 gloo processes, dp=2, every dp rank taking its half of each batch) under combined 1F1B (vp 1
and 2) and 1F1B equal litgpt's own training on one device (float64, losses and parameters after
three AdamW steps, 1e-9), with litgpt's parameter names; under combined 1F1B the MoE layers'
all-to-alls really overlap (their schedule nodes are paired in the steady state).

The one-device reference is litgpt itself (``GPT.forward``, litgpt's loss), accumulating the
same microbatches as the pipeline: each data-parallel slice of the batch cut into the same
microbatches, each slice's microbatches summed in order, the slices' sums added (the
data-parallel all-reduce) and multiplied by ``1 / token count`` (the runtime's normalisation), so
the float sums match wherever the layout allows (litgpt's RMSNorm rounds to float32 even in a
float64 model, so a differently rounded activation would show at 1e-8). After one step every
non-expert parameter is bitwise litgpt's. The expert weights are not, by design of expert
parallelism: an expert gets the rows of both data-parallel replicas in one all-to-all and
multiplies them in one matrix product, where one device multiplies each replica's rows
separately and adds the two gradients: float64 rounding, at most about 1e-13 relative after three
steps (measured), far inside 1e-9.

Single-process cases hold the layer to litgpt bit for bit at ep=1 (outputs and gradients, plain
and node execution), for both families and for the block variants they do not use: parallel
residual with LayerNorm, post-attention and post-MLP norms, shared experts, the grouped top-k
router and a routed scaling factor (the last three also run at pp=2 x ep=2 above).
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("litgpt")

from distributed import run_distributed  # noqa: E402
from litgpt_models import VOCAB, Holder, adamw, tiny_config, token_batches  # noqa: E402

from litgpt.utils import chunked_cross_entropy  # noqa: E402

PP, EP, WORLD = 2, 2, 4
DP = WORLD // PP
MICROBATCHES = 4
BATCH = DP * MICROBATCHES * 2  # two samples per microbatch
MOE = dict(mlp_class_name="LLaMAMoE", n_expert=4, n_expert_per_token=2, moe_intermediate_size=24)
# Block variants beyond Mixtral's and Qwen3's (pre-norm RMSNorm, sequential residual, plain gate).
VARIANTS = {
    "parallel-residual": ("pythia-14m", MOE),  # LayerNorm, parallel residual, biases
    "shared-grouped": ("gemma-2-2b", dict(MOE, n_shared_expert=1, routed_scaling_factor=2.5, n_expert_groups=2,
                                          n_topk_groups=1, n_topk_scores_per_group=2, norm_topk_prob=True)),
}
SCHEDULES = [dict(schedule="combined_1f1b", vp=1), dict(schedule="combined_1f1b", vp=2), dict(schedule="1f1b", vp=1)]
CASES = [dict(name=name, **s) for name in ("Mixtral-8x7B-v0.1", "Qwen3-30B-A3B") for s in SCHEDULES] + [
    dict(name="shared-grouped", **SCHEDULES[0]),  # shared experts stay dense under expert parallelism
]


def _make(name: str) -> Holder:
    """A tiny float64 model of ``name`` (a litgpt config name or a key of VARIANTS)."""
    base, overrides = VARIANTS.get(name, (name, {}))
    torch.manual_seed(11)
    holder = Holder(tiny_config(base, **overrides)).double()
    for module in holder.modules():
        if type(module).__name__ == "GroupedTopkRouter":  # litgpt leaves its weight uninitialised
            with torch.no_grad():
                module.weight.copy_(0.3 * torch.randn(module.weight.shape, dtype=torch.float64,
                                                      generator=torch.Generator().manual_seed(1)))
    return holder


def _batches():
    return token_batches(5, batch=BATCH)


def _dp_slice(batch, dp_rank: int):
    """Data-parallel rank ``dp_rank``'s contiguous share of a batch (both of litgpt's forms)."""
    if isinstance(batch, dict):
        return {k: torch.tensor_split(v, DP)[dp_rank] for k, v in batch.items()}
    return torch.tensor_split(batch, DP)[dp_rank]


def _inputs_targets(batch):
    if isinstance(batch, dict):  # fine-tuning form: output n predicts label n + 1
        return batch["input_ids"], batch["labels"], True
    return batch[:, :-1], batch[:, 1:], False


def _reference(holder: Holder, batches):
    """litgpt on one device, accumulating the pipeline's microbatches (see the module docstring).
    Returns litgpt's loss of each whole batch and the final parameters by name."""
    gpt = copy.deepcopy(holder).model
    opt = adamw(gpt.parameters())
    losses = []
    for batch in batches:
        inputs, targets, shift = _inputs_targets(batch)
        with torch.no_grad():
            logits = gpt(inputs)
            losses.append(float(chunked_cross_entropy(logits[..., :-1, :] if shift else logits,
                                                      targets[..., 1:] if shift else targets)))
        replica_sums, count = [], 0
        for dp_rank in range(DP):  # each data-parallel replica's gradient sum, microbatches in order
            x_all, y_all, _ = _inputs_targets(_dp_slice(batch, dp_rank))
            for x, y in zip(torch.tensor_split(x_all, MICROBATCHES), torch.tensor_split(y_all, MICROBATCHES)):
                logits = gpt(x)
                if shift:
                    logits, y = logits[..., :-1, :], y[..., 1:]
                torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="sum").backward()
                count += int((y != -100).sum())
            replica_sums.append({n: p.grad for n, p in gpt.named_parameters() if p.grad is not None})
            gpt.zero_grad(set_to_none=True)
        for n, p in gpt.named_parameters():
            grads = [s[n] for s in replica_sums if n in s]
            if grads:
                p.grad = (grads[0] + grads[1] if len(grads) == 2 else grads[0]).mul_(1.0 / count)
        opt.step()
        opt.zero_grad()
    return losses, {f"model.{n}": p.detach().clone() for n, p in gpt.named_parameters()}


def _pipelined(rank, world, cases):
    from lightning_pp.integrations.litgpt_moe import MoEBlockLayer
    from lightning_pp.runtime import build_pipeline
    from moe_models import count_overlaps

    overlapped, stop_counting = count_overlaps()  # one MoE layer's F with another's B
    out = []
    for case in cases:
        holder = _make(case["name"])
        executor = build_pipeline(holder, pipeline_parallel_size=PP, virtual_pipeline_size=case["vp"],
                                  num_microbatches=MICROBATCHES, schedule=case["schedule"], expert_parallel_size=EP)
        topo = executor.topology
        moe_layers = [layer for chunk in executor.partition.chunks for layer in chunk.layers
                      if isinstance(layer, MoEBlockLayer)]
        opt = adamw(holder.parameters())
        overlapped.clear()
        losses = []
        for batch in _batches():
            losses.append(float(executor.train_step(_dp_slice(batch, topo.dp_rank)).loss))
            opt.step()
            opt.zero_grad()
        names = executor.partition.parameter_names
        params = {names[id(p)]: p.detach().clone() for p in holder.parameters()}
        experts = {n for n, p in holder.named_parameters() if getattr(p, "_lpp_expert", False)}
        a2a_waits = sum(1 for span in executor.timeline.spans if span.kind == "a2a_wait")
        keys = sorted(holder.state_dict())
        # A one-device litgpt state dict (what load_checkpoint reads) loads into the cut, sharded model.
        one_device = _make(case["name"]).state_dict()
        holder.load_state_dict(one_device)
        reloaded = all(torch.equal(p, one_device[n]) for n, p in holder.named_parameters())
        out.append(dict(losses=losses, params=params, experts=experts, keys=keys, reloaded=reloaded,
                        overlapped=sum(overlapped), moe_layers=len(moe_layers), a2a_waits=a2a_waits,
                        dp_rank=topo.dp_rank, ep_rank=topo.ep_rank))
        executor.close()
    stop_counting()
    return out


@pytest.fixture(scope="module")
def pipelined():
    return run_distributed(_pipelined, WORLD, CASES, timeout=420)


@pytest.mark.timeout(480)
@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{c['name']}-{c['schedule']}-vp{c['vp']}" for c in CASES])
def test_moe_family_pp2_ep2_equals_litgpt_on_one_device(pipelined, index):
    case = CASES[index]
    ref_losses, ref_params = _reference(_make(case["name"]), _batches())
    one_device_keys = set(_make(case["name"]).state_dict())
    seen, keys = set(), set()
    for rank, results in enumerate(pipelined):
        got = results[index]
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-9), f"rank {rank}"
        for name, value in got["params"].items():
            torch.testing.assert_close(value, ref_params[name], rtol=1e-9, atol=1e-9, msg=f"{name} on rank {rank}")
            seen.add(name)
        # Expert parallelism: this rank holds experts 2 * ep_rank and 2 * ep_rank + 1 of each of its
        # blocks (4 experts over 2 ranks), marked as expert parameters; nothing else is marked
        # (the shared experts are dense).
        held = {int(n.split(".mlp.experts.")[1].split(".")[0]) for n in got["params"] if ".mlp.experts." in n}
        assert held == {2 * got["ep_rank"], 2 * got["ep_rank"] + 1}, (rank, held)
        assert got["experts"] == {n for n in got["params"] if ".mlp.experts." in n}
        # litgpt's names: each rank's state dict keys are one-device keys, all of them together.
        assert set(got["keys"]) <= one_device_keys, set(got["keys"]) - one_device_keys
        keys |= set(got["keys"])
        assert got["reloaded"], f"rank {rank}: the one-device state dict did not load into the sharded model"
        assert got["moe_layers"] > 0
        assert got["a2a_waits"] > 0  # the expert all-to-alls ran (asynchronously, waited on)
        if case["schedule"] == "combined_1f1b":
            assert got["overlapped"] > 0, f"rank {rank}: no MoE layer's forward was paired with another's backward"
        else:
            assert got["overlapped"] == 0
    assert seen == set(ref_params)
    assert keys == one_device_keys


# -- one process: the layer is litgpt's block, bit for bit ----------------------------------------
@pytest.mark.parametrize("name", ["Mixtral-8x7B-v0.1", "Qwen3-30B-A3B", *VARIANTS])
def test_moe_block_layer_is_litgpt_block_bit_for_bit(name):
    from lightning_pp.integrations.litgpt import pipeline_layers
    from lightning_pp.integrations.litgpt_moe import MoEBlockLayer
    from lightning_pp.runtime.plans.nodes import ChunkSchedulePlan

    holder = _make(name)
    idx = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(2))
    reference = copy.deepcopy(holder)
    want = reference.model(idx)
    weights = torch.randn(want.shape, dtype=want.dtype, generator=torch.Generator().manual_seed(3))
    (want * weights).sum().backward()
    want_grads = {n: p.grad for n, p in reference.named_parameters()}
    for mode in ("plain", "nodes"):
        model = copy.deepcopy(holder)
        layers = pipeline_layers(model.model)
        assert all(isinstance(layer, MoEBlockLayer) for layer in layers[1:-1])
        if mode == "plain":
            out = idx
            for layer in layers:
                out = layer(out)
            (out * weights).sum().backward()
        else:  # the node path of combined 1F1B, one microbatch
            embedded = layers[0](idx)
            plan = ChunkSchedulePlan(layers[1:-1])
            (hidden,) = plan.forward((embedded.detach().requires_grad_(),))
            hidden = hidden.detach().requires_grad_()
            out = layers[-1](hidden)
            (out * weights).sum().backward()
            (grad,) = plan.backward((hidden.grad,))
            embedded.backward(grad)
        assert torch.equal(out, want), mode
        for n, p in model.named_parameters():
            assert (p.grad is None) == (want_grads[n] is None), (mode, n)
            assert p.grad is None or torch.equal(p.grad, want_grads[n]), (mode, n)
    if name == "shared-grouped":  # the variant really has what it is meant to test
        moe = holder.model.transformer.h[0].mlp
        assert type(moe.gate).__name__ == "GroupedTopkRouter" and hasattr(moe, "shared_experts")


def test_experts_not_divisible_by_expert_parallel_size_names_the_config_field():
    from lightning_pp.integrations.litgpt_moe import MoEBlockLayer

    torch.manual_seed(0)
    gpt = Holder(tiny_config("Mixtral-8x7B-v0.1", n_expert=3)).model
    with pytest.raises(ValueError, match=r"config.n_expert=3 is not divisible by expert_parallel_size=2"):
        MoEBlockLayer(gpt, 0).setup_expert_parallel(None, 0, 2, torch.device("cpu"))

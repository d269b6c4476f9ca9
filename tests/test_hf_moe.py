"""Hugging Face mixture-of-experts models expert-parallel, their fused expert tensors sharded by
rows under HF's names (``lightning_pp.integrations.hf_moe``): tiny Qwen3-MoE, Mixtral, Qwen2-MoE (a shared expert) and GPT-OSS at
pp=2 x ep=2 (4 gloo processes, dp=2: each data-parallel rank takes its half of every batch) under
combined 1F1B (vp 1 and 2), 1F1B and DualPipeV, equal to the same HF model trained on one device (float64,
1e-9: losses and every parameter by its HF name, a rank's expert rows against the same rows of the
one-device tensor). In the same launch: under combined 1F1B the MoE layers' all-to-alls overlap
another microbatch's compute; a sharded checkpoint saved at ep=2 resumes at ep=1 and one saved at
ep=1 resumes at ep=2, optimizer included, equal to the uninterrupted run; a one-device state dict
loads into the sharded model; the trained model saves a directory ``from_pretrained`` loads; a
model built on the meta device at ep=2 gets the weights a one-device materialisation gives, and
reads only its rows of a ``save_pretrained`` directory.

The one-device reference is :func:`hf_models.one_device`: the batch cut into 8 microbatches, which
are the pipeline's (4 per data-parallel half, in order), so HF's float32 norms round alike."""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

from distributed import run_distributed  # noqa: E402
from hf_models import STEPS, HFFromPretrained, HFPipe, batches, make_hf, one_device  # noqa: E402

PP, EP, WORLD = 2, 2, 4
CASES = [("qwen3_moe", "combined_1f1b", 1), ("qwen3_moe", "combined_1f1b", 2), ("mixtral", "1f1b", 1),
         ("mixtral", "combined_1f1b", 1), ("qwen3_moe", "dualpipev", 2), ("qwen2_moe", "combined_1f1b", 1),
         ("gpt_oss", "combined_1f1b", 1)]
SEED = 5


def _dp_slice(batch, topology):
    return {k: torch.tensor_split(v, topology.dp)[topology.dp_rank] for k, v in batch.items()}


def _rows(p):
    """(first global row held here, the tensor) of a stacked expert parameter; (None, it) of any other."""
    from lightning_pp.runtime.cut.stacked import stacked_rows

    from lightning_pp.runtime.dtensors import is_dtensor

    shard = stacked_rows(p)  # (with FSDP2 the rows are gathered: a DTensor's whole is the rank's rows)
    return (shard.start if shard else None), (p.full_tensor() if is_dtensor(p) else p).detach().clone()


def _build(family, schedule="combined_1f1b", vp=1, ep=EP, pipe=None, pp=PP, sharding="none"):
    """The pipeline; each data-parallel rank's share of a batch cut into microbatches of one row,
    the reference's 8 microbatches."""
    from lightning_pp.runtime import build_pipeline

    pipe = pipe if pipe is not None else HFPipe(family)
    executor = build_pipeline(pipe, pipeline_parallel_size=pp, virtual_pipeline_size=vp,
                              num_microbatches=8 * pp // WORLD, schedule=schedule, expert_parallel_size=ep,
                              data_parallel_sharding=sharding)
    return pipe, executor, torch.optim.AdamW(pipe.parameters(), lr=1e-2)


def _steps(pipe, executor, opt, steps):
    losses = []
    for batch in steps:
        losses.append(float(executor.train_step(_dp_slice(batch, executor.topology)).loss))
        opt.step()
        opt.zero_grad()
    return losses


def _params(pipe, executor):
    names = executor.partition.parameter_names
    return {names[id(p)].removeprefix("model."): _rows(p) for p in pipe.parameters()}


def _save(pipe, opt, path):
    from lightning_pp.strategies import checkpoint as ckpt

    ckpt.save(path, {"model": pipe.state_dict(), "optimizer_0": ckpt.optimizer_state(pipe, opt)}, {})


def _load(pipe, opt, path):
    from lightning_pp.strategies import checkpoint as ckpt

    ckpt.load(path, {"model": pipe.state_dict(), "optimizer_0": ckpt.OptimizerShard(pipe, opt)})


def _train_cases(rank, world, dst):
    from lightning_pp.integrations import hf
    from lightning_pp.integrations.hf_moe import HFMoEDecoderLayer
    from moe_models import count_overlaps

    overlapped, stop_counting = count_overlaps()  # one MoE layer's F with another's B
    out = []
    for i, (family, schedule, vp) in enumerate(CASES):
        pipe, executor, opt = _build(family, schedule, vp)
        overlapped.clear()
        losses = _steps(pipe, executor, opt, batches())
        moe = [m for chunk in executor.partition.chunks for m in chunk.layers if isinstance(m, HFMoEDecoderLayer)]
        state = pipe.state_dict()
        shapes = {k.removeprefix("model."): tuple(v.shape) for k, v in state.items()}  # stacked rows: global shapes
        experts = {n for n, p in pipe.named_parameters() if getattr(p, "_lpp_expert", False)}
        a2a_waits = sum(1 for span in executor.timeline.spans if span.kind == "a2a_wait")
        result = dict(losses=losses, params=_params(pipe, executor), shapes=shapes, experts=experts,
                      overlapped=sum(overlapped), moe_layers=len(moe), a2a_waits=a2a_waits, ep_rank=executor.topology.ep_rank)
        if i == 0:
            hf.save_pretrained(pipe.model, dst)  # consolidated from every rank's rows
            one = make_hf(family).state_dict()  # a one-device state dict loads: each rank keeps its rows
            pipe.model.load_state_dict(one)
            result["reloaded"] = all(torch.equal(p, one[n].narrow(0, s, p.shape[0]) if s is not None else one[n])
                                     for n, (s, p) in _params(pipe, executor).items())
        out.append(result)
        executor.close()
    stop_counting()
    return out


def _resume_cases(rank, world, tmp):
    """Two steps at one expert-parallel size, a checkpoint, the third step at the other."""
    out = []
    for first, second in ((EP, 1), (1, EP)):
        path = f"{tmp}/ep{first}"
        pipe, executor, opt = _build("qwen3_moe", ep=first)
        _steps(pipe, executor, opt, batches()[:2])
        _save(pipe, opt, path)
        executor.close()
        pipe, executor, opt = _build("qwen3_moe", ep=second, schedule="1f1b")
        _load(pipe, opt, path)
        losses = _steps(pipe, executor, opt, batches()[2:])
        out.append(dict(losses=losses, params=_params(pipe, executor)))
        executor.close()
    return out


def _meta_cases(rank, world, src):
    from lightning_pp.integrations import hf

    torch.manual_seed(SEED)
    pipe = HFFromPretrained(src)
    pipe, executor, _ = _build("qwen3_moe", pipe=pipe)
    initialised = _params(pipe, executor)
    read = hf.load_pretrained(pipe.model, src)
    loaded = _params(pipe, executor)
    held = sum(p.numel() * p.element_size() for p in pipe.model.parameters())
    executor.close()
    return dict(initialised=initialised, read=read, loaded=loaded, held=held)


def _sharded_cases(rank, world, tmp):
    """data_parallel_sharding="full": at pp=2 x ep=2 (edp=1: the experts' rows stay whole, the rest
    sharded over dp=2), and at pp=1 x ep=2 x edp=2 (each rank's rows sharded again over its edp
    pair), whose checkpoint after two steps resumes unsharded at pp=2 x ep=1."""
    from lightning_pp.integrations import hf
    from lightning_pp.strategies import checkpoint as ckpt

    out = []
    pipe, executor, opt = _build("qwen3_moe", sharding="full")
    out.append(dict(losses=_steps(pipe, executor, opt, batches()), params=_params(pipe, executor)))
    executor.close()
    pipe, executor, opt = _build("qwen3_moe", pp=1, sharding="full")
    nested = any(getattr(getattr(p, "_lpp_stacked", None), "nested", None) is not None for p in pipe.parameters())
    losses = _steps(pipe, executor, opt, batches()[:2])
    _save(pipe, opt, f"{tmp}/sharded")
    losses += _steps(pipe, executor, opt, batches()[2:])
    hf.save_pretrained(pipe.model, f"{tmp}/sharded_hf")
    out.append(dict(losses=losses, params=_params(pipe, executor), nested=nested))
    one = {f"model.{k}": v for k, v in make_hf("qwen3_moe").state_dict().items()}
    ckpt.load_full_state_dict(pipe, one)  # a one-device state dict: each rank takes its shard of its rows
    out.append(dict(params=_params(pipe, executor)))
    executor.close()
    pipe, executor, opt = _build("qwen3_moe", schedule="1f1b", ep=1)
    _load(pipe, opt, f"{tmp}/sharded")
    out.append(dict(losses=_steps(pipe, executor, opt, batches()[2:]), params=_params(pipe, executor)))
    executor.close()
    return out


def _all_cases(rank, world, tmp):
    return (_train_cases(rank, world, f"{tmp}/trained"), _resume_cases(rank, world, tmp),
            _meta_cases(rank, world, f"{tmp}/src"), _sharded_cases(rank, world, tmp))


def _check(params, reference, what):
    seen = set()
    for name, (start, value) in params.items():
        expected = reference[name] if start is None else reference[name].narrow(0, start, value.shape[0])
        torch.testing.assert_close(value, expected, rtol=1e-9, atol=1e-12, msg=f"{what}: {name}")
        seen.add(name)
    return seen


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_moe")
    make_hf("qwen3_moe").save_pretrained(str(tmp / "src"), max_shard_size="20KB")
    return tmp, run_distributed(_all_cases, WORLD, str(tmp), timeout=400)


@pytest.mark.timeout(480)
def test_hf_moe_pp2_ep2_equals_one_device_under_every_schedule_with_hf_names(launched):
    _, per_rank = launched
    for i, (family, schedule, vp) in enumerate(CASES):
        ref_losses, ref_params = one_device(family, microbatches=8)
        one_device_shapes = {k: tuple(v.shape) for k, v in make_hf(family).state_dict().items()}
        seen, keys = set(), set()
        for rank in range(WORLD):
            got = per_rank[rank][0][i]
            assert got["losses"] == pytest.approx(ref_losses, rel=1e-9), (family, schedule, vp, rank)
            seen |= _check(got["params"], ref_params, f"{family} {schedule} vp={vp} rank {rank}")
            # Each rank holds rows 2 * ep_rank, 2 * ep_rank + 1 of every fused expert tensor (4 experts
            # over 2 ranks), marked as expert parameters, and nothing else is.
            stacked = {n: s for n, (s, v) in got["params"].items() if s is not None}
            assert stacked and set(stacked.values()) == {2 * got["ep_rank"]}, (rank, stacked)
            assert {n.removeprefix("model.") for n in got["experts"]} == set(stacked)
            assert all(got["params"][n][1].shape[0] == 2 for n in stacked)
            # HF's names and shapes: every state dict entry is a one-device one (the rows as the global tensor).
            assert all(one_device_shapes[k] == shape for k, shape in got["shapes"].items()), rank
            keys |= set(got["shapes"])
            assert got["moe_layers"] > 0 and got["a2a_waits"] > 0
            if schedule == "combined_1f1b":
                assert got["overlapped"] > 0, f"rank {rank}: no MoE layer's forward was paired with another's backward"
            elif schedule == "1f1b":
                assert got["overlapped"] == 0
        assert seen == set(ref_params) and keys == set(one_device_shapes), family
    assert all(per_rank[rank][0][0]["reloaded"] for rank in range(WORLD))


@pytest.mark.timeout(480)
def test_a_checkpoint_saved_at_one_expert_parallel_size_resumes_at_another(launched):
    _, per_rank = launched
    ref_losses, ref_params = one_device("qwen3_moe", microbatches=8)
    for direction in range(2):
        seen = set()
        for rank in range(WORLD):
            got = per_rank[rank][1][direction]
            assert got["losses"] == pytest.approx(ref_losses[2:], rel=1e-9), (direction, rank)
            seen |= _check(got["params"], ref_params, f"resume {direction} rank {rank}")
        assert seen == set(ref_params)


@pytest.mark.timeout(480)
def test_trained_experts_save_as_a_directory_from_pretrained_loads(launched):
    tmp, per_rank = launched
    _, ref_params = one_device("qwen3_moe", microbatches=8)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp / "trained"), dtype=torch.float64)
    for name, p in reloaded.named_parameters():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.timeout(480)
def test_meta_init_at_ep2_equals_one_device_and_each_rank_reads_only_its_rows(launched):
    from lightning_pp.integrations import hf
    from lightning_pp.runtime.cut.meta import materialize

    tmp, per_rank = launched
    config = transformers.AutoConfig.from_pretrained(str(tmp / "src"))
    with torch.device("meta"):
        whole = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    holder = nn.Module()
    holder.model = whole
    materialize(holder, torch.device("cpu"), SEED, lambda module: hf.init_weights(whole, module))
    initialised = {n: p.detach() for n, p in whole.named_parameters()}
    saved = {n: p.detach() for n, p in make_hf("qwen3_moe").named_parameters()}
    total = sum(p.numel() * p.element_size() for p in saved.values())
    for rank in range(WORLD):
        got = per_rank[rank][2]
        _check(got["initialised"], initialised, f"meta init rank {rank}")
        _check(got["loaded"], saved, f"loaded rank {rank}")
        # Only its own tensors, and of the fused experts only its rows: what it read is what it holds.
        assert got["read"]["bytes"] == got["held"] < total / 2, (rank, got["read"], got["held"], total)


@pytest.mark.timeout(480)
def test_fused_experts_under_full_data_parallel_sharding_equal_one_device_and_resume_unsharded(launched):
    tmp, per_rank = launched
    ref_losses, ref_params = one_device("qwen3_moe", microbatches=8)
    saved = {n: p.detach() for n, p in make_hf("qwen3_moe").named_parameters()}
    for case, what in ((0, "pp=2 x ep=2, sharded"), (1, "pp=1 x ep=2 x edp=2, sharded"), (3, "resumed unsharded")):
        seen = set()
        for rank in range(WORLD):
            got = per_rank[rank][3][case]
            expected = ref_losses[2:] if case == 3 else ref_losses
            assert got["losses"] == pytest.approx(expected, rel=1e-9), (what, rank)
            seen |= _check(got["params"], ref_params, f"{what} rank {rank}")
        assert seen == set(ref_params), what
    assert all(per_rank[rank][3][1]["nested"] for rank in range(WORLD))  # the rows really sharded twice
    for rank in range(WORLD):
        _check(per_rank[rank][3][2]["params"], saved, f"one-device state dict into the sharded model, rank {rank}")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp / "sharded_hf"), dtype=torch.float64)
    for name, p in reloaded.named_parameters():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-9, atol=1e-12, msg=name)


assert STEPS == 3  # the resume cases split the reference's three steps as 2 + 1


def test_compile_compiles_an_hf_moe_layers_parts_and_keeps_its_numbers():
    """compile= on HFMoEDecoderLayer compiles the modules its routing calls (norms, attention,
    router: compile_parts), not the HF decoder layer it holds, whose own forward never runs;
    aot_eager keeps eager's kernels, so outputs and gradients are equal bit for bit."""
    from lightning_pp.integrations import hf
    from lightning_pp.runtime.compile.watch import compile_counts
    from lightning_pp.runtime.compile.layers import compile_pipeline_layers

    torch._dynamo.reset()
    compiled, eager = make_hf("qwen3_moe"), make_hf("qwen3_moe")
    layers, reference = hf.pipeline_layers(compiled), hf.pipeline_layers(eager)
    compile_pipeline_layers(layers[1:-1], {"backend": "aot_eager"}, False)

    def run(stack):
        x = hf.pipeline_inputs(batches()[0])
        for layer in stack:
            x = layer(*x) if isinstance(x, tuple) else layer(x)
        return x

    out, expected = run(layers), run(reference)
    out.sum().backward()
    expected.sum().backward()
    assert torch.equal(out, expected)
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert compile_counts()["graphs"] >= 3  # the norm, the attention and the router, each compiled once

"""Single-process tests of the runtime's pure parts: sizes, layouts, cutting, splitting."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pp.runtime.cut.layout import parse_layout_string, resolve_layout
from lightning_pp.runtime.cut.partition import NotOnThisStage, check_protocol, cut_model
from lightning_pp.runtime.step.microbatch import split_microbatches
from lightning_pp.runtime.topology import ParallelDims
from lightning_pp.runtime.step.loss import normalise_loss
from lightning_pp.runtime.transport.p2p import decode_header, encode_header
from models import TiedLM, ToyRegressor


def test_rank_order_is_pp_outermost_and_ep_inside_one_stage():
    dims = ParallelDims(world_size=8, pp=2, ep=2).check()
    assert (dims.dp, dims.edp) == (4, 2)
    coords = [dims.coordinates(r) for r in range(8)]
    # One stage owns dp consecutive ranks; ep groups are consecutive pairs inside a stage.
    assert [c["pp"] for c in coords] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [c["ep"] for c in coords] == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [c["edp"] for c in coords] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert all(dims.rank_of(c["pp"], c["dp"]) == r for r, c in enumerate(coords))


@pytest.mark.parametrize("world,pp,ep", [(6, 4, 1), (4, 2, 3), (8, 3, 1)])
def test_indivisible_world_is_rejected_with_the_sizes(world, pp, ep):
    with pytest.raises(ValueError) as err:
        ParallelDims(world, pp, ep).check()
    msg = str(err.value)
    assert f"world size {world}" in msg and f"{pp} * {ep}" in msg and "Use" in msg


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_non_positive_sizes_are_rejected(bad):
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        ParallelDims(4, bad).check()


def test_layout_strings():
    assert parse_layout_string("Et*2|(tt|)*2tL") == [3, 2, 2, 2]
    assert parse_layout_string("E|t|t*4|tL") == [1, 1, 4, 2]
    assert parse_layout_string("(t|)*3t") == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="layout="):
        parse_layout_string("E|t3")


def test_layout_validation_names_the_rule():
    assert resolve_layout(None, 8, 3) == [3, 3, 2]
    with pytest.raises(ValueError, match="sums to 7 layers.*returns 8"):
        resolve_layout([3, 4], 8, 2)
    with pytest.raises(ValueError, match="describes 3 stages"):
        resolve_layout([3, 3, 2], 8, 2)
    with pytest.raises(ValueError, match="at least one layer"):
        resolve_layout([8, 0], 8, 2)
    with pytest.raises(ValueError, match="too few for 4 virtual stages"):
        resolve_layout(None, 3, 4)


def test_protocol_errors_name_the_missing_method():
    class NoLoss(nn.Module):
        def pipeline_layers(self):
            return []

    with pytest.raises(TypeError, match="`pipeline_loss`"):
        check_protocol(NoLoss())
    with pytest.raises(TypeError, match="`pipeline_layers`, `pipeline_loss`"):
        check_protocol(nn.Linear(2, 2))


def test_cut_keeps_only_owned_parameters_under_global_names():
    torch.manual_seed(0)
    full = {n for n, _ in ToyRegressor(blocks=4).named_parameters()}
    owned = []
    for rank in range(2):
        torch.manual_seed(0)
        model = ToyRegressor(blocks=4)
        part = cut_model(model, pp=2, vp=1, pp_rank=rank)
        names = {n for n, _ in model.named_parameters()}
        owned.append(names)
        assert part.layout == [3, 3]
        assert sum(isinstance(m, NotOnThisStage) for m in model.modules()) == 3
    assert owned[0] | owned[1] == full and not owned[0] & owned[1]
    assert all(n.startswith(("embed", "blocks.0", "blocks.1")) for n in owned[0])


def test_cut_interleaved_places_stage_s_on_rank_s_mod_pp():
    model = ToyRegressor(blocks=6)  # 8 layers, 4 virtual stages of 2
    part = cut_model(model, pp=2, vp=2, pp_rank=1)
    assert [c.stage for c in part.chunks] == [1, 3]
    assert [c.first_layer for c in part.chunks] == [2, 6]


def test_tied_parameters_are_found_and_kept_on_both_stages():
    model = TiedLM(blocks=2)
    part = cut_model(model, pp=2, vp=1, pp_rank=1)
    assert [(t.name, t.pp_ranks) for t in part.tied] == [("embed.weight", (0, 1))]
    assert model.head.weight is not None and len(list(model.parameters())) > 0
    assert not isinstance(model.head, NotOnThisStage) and isinstance(model.embed, NotOnThisStage)


def test_calling_a_removed_layer_explains_itself():
    model = ToyRegressor(blocks=2)
    cut_model(model, pp=2, vp=1, pp_rank=1)
    with pytest.raises(RuntimeError, match="lives on virtual stage 0"):
        model.embed(torch.zeros(1, 5))


def test_split_is_uneven_by_at_most_one_and_covers_the_batch():
    x, y = torch.arange(11).view(11, 1), torch.arange(11)
    parts = split_microbatches((x, y, "meta", {"w": torch.ones(11)}), 5)
    assert [p[0].shape[0] for p in parts] == [3, 2, 2, 2, 2]
    assert torch.cat([p[1] for p in parts]).tolist() == list(range(11))
    assert all(p[2] == "meta" and p[3]["w"].shape[0] == p[0].shape[0] for p in parts)
    with pytest.raises(ValueError, match="batch of size 3 cannot be split into num_microbatches=4"):
        split_microbatches((torch.zeros(3, 2),), 4)


def test_loss_normalisation_forms():
    s, c = normalise_loss(torch.tensor(2.0), samples=3)
    assert float(s) == 6.0 and float(c) == 3.0
    s, c = normalise_loss((torch.tensor(5.0), torch.tensor(4)), samples=3)
    assert float(s) == 5.0 and float(c) == 4.0
    with pytest.raises(ValueError, match="scalar tensor"):
        normalise_loss(torch.ones(3), samples=3)


def test_header_roundtrip_carries_shapes_dtypes_and_grad_flags():
    a = torch.zeros(2, 3, 4, requires_grad=True)
    b = torch.ones(7, dtype=torch.int64)
    specs, as_tuple = decode_header(encode_header((a, b), torch.device("cpu"), as_tuple=True))
    assert as_tuple and specs == [(torch.float32, True, (2, 3, 4)), (torch.int64, False, (7,))]


class _Adapter(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


class _KeptInside(nn.Module):
    """Layers that live inside ``self.model``, the last one an adapter made on the fly."""

    def __init__(self, extra=None):
        super().__init__()
        self.model = ToyRegressor(blocks=2)
        if extra is not None:
            self.extra = extra

    def pipeline_layers(self):
        return [self.model.embed, *self.model.blocks, _Adapter(self.model.head)]

    def pipeline_loss(self, output, batch):
        return output.pow(2).mean()


def test_cut_removes_what_only_other_ranks_reach_wherever_it_is_referenced():
    for rank, expected in ((0, {"model.embed", "model.blocks.0"}), (1, {"model.blocks.1", "model.head"})):
        model = _KeptInside()
        cut_model(model, pp=2, vp=1, pp_rank=rank)
        held = {n for n, _ in model.named_parameters()}
        assert {prefix for prefix in expected if any(n.startswith(prefix + ".") for n in held)} == expected
        assert all(n.startswith(tuple(p + "." for p in expected)) for n in held), (rank, held)


def test_a_trainable_parameter_no_layer_reaches_is_named_at_the_cut():
    with pytest.raises(ValueError, match=r"1 trainable parameter\(s\) of _KeptInside belong to no pipeline layer: extra.weight"):
        cut_model(_KeptInside(extra=nn.Linear(2, 2, bias=False)), pp=2, vp=1, pp_rank=0)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    model = _KeptInside(extra=frozen)
    cut_model(model, pp=2, vp=1, pp_rank=1)  # frozen: kept on every rank
    assert model.extra is frozen


class _ScaledHead(nn.Module):
    """An adapter made on the fly around the root's bare parameter."""

    def __init__(self, head, scale):
        super().__init__()
        self.head, self.scale = head, scale

    def forward(self, x):
        return self.head(x) * self.scale


class _BareScale(_KeptInside):
    """A bare ``nn.Parameter`` on the root, handed to the last layer's adapter (or, with
    ``handed=False``, used by no layer)."""

    def __init__(self, handed=True):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.handed = handed

    def pipeline_layers(self):
        head = _ScaledHead(self.model.head, self.scale) if self.handed else _Adapter(self.model.head)
        return [self.model.embed, *self.model.blocks, head]


def test_a_bare_parameter_no_layer_reaches_is_named_with_how_to_move_it():
    with pytest.raises(ValueError, match=r"belong to no pipeline layer: scale\..*bare nn.Parameter such as `scale`"
                                         r".*`self.scale = scale`"):
        cut_model(_BareScale(handed=False), pp=2, vp=1, pp_rank=0)


def test_a_bare_parameter_is_held_only_by_the_rank_of_the_layer_that_uses_it():
    torch.manual_seed(3)
    one_device = _BareScale().state_dict()
    for rank, holds in ((0, False), (1, True)):
        model = _BareScale()
        cut_model(model, pp=2, vp=1, pp_rank=rank)
        assert ("scale" in dict(model.named_parameters())) is holds
        assert ("scale" in model.state_dict()) is holds
        model.load_state_dict(one_device)  # strict: rank 0 drops the entry rank 1 loads


def test_meta_model_materialises_only_what_the_rank_keeps_with_the_one_device_values():
    from lightning_pp.runtime.cut.meta import materialize

    with torch.device("meta"):
        full = ToyRegressor(blocks=4)
    materialize(full, torch.device("cpu"), seed=7)  # one device: the whole model, same procedure
    expected = {n: p.detach().clone() for n, p in full.named_parameters()}
    for rank in range(2):
        with torch.device("meta"):
            model = ToyRegressor(blocks=4)
        others = [model.embed, model.blocks[0], model.blocks[1]] if rank == 1 else [model.blocks[2], model.blocks[3], model.head]
        part = cut_model(model, pp=2, vp=1, pp_rank=rank)
        part.follow(materialize(model, torch.device("cpu"), seed=7))
        for name, p in model.named_parameters():
            assert not p.is_meta and p.untyped_storage().nbytes() == p.numel() * p.element_size(), name
            torch.testing.assert_close(p, expected[name], rtol=0, atol=0)
            assert part.parameter_names[id(p)] == name  # the partition follows the new tensors
        # the layers another rank holds were never given memory
        assert all(p.is_meta for layer in others for p in layer.parameters())


def test_one_device_state_dict_loads_into_a_cut_model_strictly():
    torch.manual_seed(3)
    one_device = ToyRegressor(blocks=4).state_dict()
    model = ToyRegressor(blocks=4)
    cut_model(model, pp=2, vp=1, pp_rank=1)
    model.load_state_dict(one_device)  # strict: the other rank's keys are absorbed by its placeholders
    for name, value in model.state_dict().items():
        assert torch.equal(value, one_device[name]), name


def test_sent_outputs_are_kept_as_autograd_edges_freed_when_nothing_else_holds_them():
    import gc
    import weakref

    import torch.nn.functional as F

    from lightning_pp.runtime.plans.weight_grad import engine_backward
    from lightning_pp.runtime.step.stage import kept_for_backward

    torch.manual_seed(0)
    lin = nn.Linear(3, 3).double()
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)  # a received input: a leaf
    ids = torch.arange(4)

    def stage():
        h = lin(x) + 1.0  # the sum saves nothing: a chain's output
        c = torch.tanh(lin(x))
        y = h * F.silu(c)  # SiLU saves c, which is sent on as well
        return y, c, x, ids  # x passed through unchanged, ids needs no gradient

    outputs = stage()
    grads = [torch.randn(4, 3, dtype=torch.float64) for _ in range(3)]
    engine_backward(list(outputs[:3]), grads)  # the reference: a backward from the tensors themselves
    expected = (x.grad.clone(), lin.weight.grad.clone())
    x.grad, lin.weight.grad, lin.bias.grad = None, None, None

    outputs = stage()
    y_ref, c_ref = weakref.ref(outputs[0]), weakref.ref(outputs[1])
    kept = kept_for_backward(outputs)
    assert kept[2] is x and kept[3] is None  # a leaf is kept as it is; no gradient, nothing kept
    del outputs
    gc.collect()
    assert y_ref() is None  # nothing but the stash held y: freed once sent
    assert c_ref() is not None  # SiLU's saved tensor: autograd keeps it, untouched
    engine_backward([k for k in kept if k is not None and k is not ids], grads)
    torch.testing.assert_close((x.grad, lin.weight.grad), expected, rtol=0, atol=0)

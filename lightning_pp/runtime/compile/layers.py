"""``compile=``: pipeline layers compiled in place, their backward split for the zero-bubble schedules.

:func:`compile_pipeline_layers` (called by ``build_pipeline`` last) compiles each layer's forward
with one shared backend object, an MoE block by its parts (:func:`compile_targets`), and marks
batch and sequence dimensions dynamic once sizes change (docs/compile.md says why each).

A ``torch.compile``d layer is one autograd node (``CompiledFunctionBackward``): the zero-bubble
``B`` / ``W`` split of :mod:`lightning_pp.runtime.plans.weight_grad` finds nothing smaller to
restart from, so its ``W`` would run the node's whole backward a second time (measured: B + W =
1.88 x the backward), and torch's donated buffers refuse the retained graph outright.

:func:`split_backend` is a ``torch.compile`` backend that splits the compiled *backward graph*
itself, once, when AOTAutograd hands it over: the part every input gradient needs (``B``: those
gradients plus the intermediate values the rest needs, the "boundary") and the rest (``W``: the
parameters' gradients, from the boundary and the saved activations). Each part is compiled on its
own by the chosen compiler (inductor by default). At run time the node asks the autograd engine
which of its gradients the current backward wants (``torch._C._will_engine_execute_node`` on its
next edges): the input gradients only (the runtime's ``B``, which asks for the stage inputs) runs
``B`` and keeps the boundary on the node; the next call on that node (the runtime's ``W``
restarting from it) runs ``W`` from what was kept; a plain backward runs both. Nothing is computed
twice. Chosen over a weight-gradient store around the layers' matmuls because it needs nothing of
the user's layer (any op, not only ``nn.Linear``) and keeps the compiler's fusion inside each part.
Under the other schedules the backward stays whole (``split=False``), one graph fusing across it.
"""

from __future__ import annotations

import logging
import types
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
from torch import fx, nn

from lightning_pp.runtime.process import CHECKPOINT, CHECKPOINT_COMPILED, COMPILED, fact, facts

log = logging.getLogger(__name__)
#: ``compile=``: ``False`` (eager), ``True`` (inductor) or ``torch.compile``'s keyword arguments.
CompileOption = Union[bool, dict[str, Any]]
#: The compilers whose backward graphs :func:`split_backend` splits for the zero-bubble ``W``.
SPLIT_COMPILERS = ("inductor", "aot_eager")
# The key, in an autograd node's ``metadata``, of what its B kept for its W (SplitBackward).
_WEIGHT_HALF = "lightning_pp_weight_half"


def _ancestors(nodes: Sequence[Any]) -> set:
    seen: set = set()
    stack = [n for n in nodes if isinstance(n, fx.Node)]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def split_backward_graph(gm: fx.GraphModule, first: set):
    """Cut a backward graph in two: part one computes the outputs at positions ``first`` and the
    boundary values part two needs; part two takes the placeholders it uses and the boundary and
    computes the other outputs. Returns (part one, part two, indices of part two's placeholders in
    the original graph, boundary nodes)."""
    outputs = list(gm.graph.output_node().args[0])
    later = [o for i, o in enumerate(outputs) if i not in first]
    in_first, in_later = _ancestors([outputs[i] for i in first]), _ancestors(later)
    only_later = in_later - in_first
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    boundary = [n for n in gm.graph.nodes if n in in_first and n.op != "placeholder"
                and (any(user in only_later for user in n.users) or n in later)]
    one, env = fx.Graph(), {}
    for node in gm.graph.nodes:
        if node.op != "output" and (node in in_first or node.op == "placeholder"):
            env[node] = one.node_copy(node, lambda n: env[n])
    one.output(tuple(env[o] if i in first and isinstance(o, fx.Node) else None for i, o in enumerate(outputs))
               + tuple(env[n] for n in boundary))
    two, env2 = fx.Graph(), {}
    kept = [i for i, n in enumerate(placeholders) if n in in_later]
    for i in kept:
        env2[placeholders[i]] = two.node_copy(placeholders[i], lambda n: None)
    for node in boundary:
        env2[node] = two.placeholder(f"{node.name}_boundary")
        env2[node].meta = dict(node.meta)
    for node in gm.graph.nodes:
        if node in only_later and node.op != "placeholder":
            env2[node] = two.node_copy(node, lambda n: env2[n])
    two.output(tuple(env2[o] if i not in first and isinstance(o, fx.Node) else None for i, o in enumerate(outputs)))
    return fx.GraphModule(gm, one), fx.GraphModule(gm, two), kept, boundary


class SplitBackward:
    """The compiled backward of one graph, as its two parts (see the module docstring)."""

    def __init__(self, first: Callable, second: Callable, is_input: list, weight_edges: list, kept: list) -> None:
        self.first, self.second, self.is_input, self.kept = first, second, is_input, kept
        self.weight_edges = weight_edges  # the node's next edges that lead to parameters
        self._boxed_call = True  # an instance attribute: torch's wrappers copy __dict__, not the class's

    def __call__(self, args: list) -> list:
        node = torch._C._current_autograd_node()
        kept = node.metadata.pop(_WEIGHT_HALF, None) if node is not None else None
        if kept is not None:  # the W restarting from this node: the weight gradients from what B kept
            out = self.second(list(kept))
            return [None if is_input else g for g, is_input in zip(out, self.is_input)]
        saved = [args[i] for i in self.kept]
        edges = node.next_functions if node is not None else ()
        weights_wanted = node is None or any(
            edges[i][0] is not None and torch._C._will_engine_execute_node(edges[i][0]) for i in self.weight_edges)
        out = self.first(args)
        n = len(self.is_input)
        grads, boundary = list(out[:n]), list(out[n:])
        if not weights_wanted:  # the runtime's B: keep the boundary for the W
            node.metadata[_WEIGHT_HALF] = saved + boundary
            return grads
        rest = self.second(saved + boundary)
        return [g if is_input else w for g, w, is_input in zip(grads, rest, self.is_input)]


def split_backend(compiler: str = "inductor", mode: Optional[str] = None, options: Optional[dict] = None,
                  split: bool = True) -> Callable:
    """A ``torch.compile`` backend whose backward graphs split into input- and weight-gradient
    parts (``compiler``: ``"inductor"``, with its ``mode`` or ``options``, or ``"aot_eager"``, which
    keeps torch's eager kernels and their order of operations). ``split=False``: the backward
    whole, for schedules without a separate ``W`` (one graph fuses across both halves)."""
    fixed_mode, fixed_options = mode, options

    def part(graph, inputs, example_inputs, compile_part):
        return _split(graph, inputs, example_inputs, compile_part) if split else compile_part(graph, inputs)

    def backend(gm: fx.GraphModule, example_inputs: list, mode: Optional[str] = fixed_mode,
                options: Optional[dict] = fixed_options):
        if compiler == "inductor":
            from torch._inductor import list_mode_options
            from torch._inductor.compile_fx import compile_fx, compile_fx_inner

            def inner(graph, inputs, **kwargs):
                if not kwargs.get("is_backward"):
                    return compile_fx_inner(graph, inputs, **kwargs)
                kwargs.pop("static_input_idxs", None)  # indices of the whole graph's inputs
                return part(graph, inputs, example_inputs, lambda g, x: _uncached(compile_fx_inner, g, x, **kwargs))

            patches = {**(list_mode_options(mode) if mode else {}), **(options or {})}  # as torch.compile does
            return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=patches)
        if mode is not None or options:
            raise ValueError(f"compile: mode={mode!r} / options={options!r} are inductor's; the {compiler!r} "
                             f"backend takes neither: drop them or use backend='inductor'.")
        if compiler == "aot_eager":
            from functorch.compile import make_boxed_func
            from torch._dynamo.backends.common import aot_autograd

            def forward(graph, inputs):
                return make_boxed_func(graph.forward)

            def backward(graph, inputs):
                return part(graph, inputs, example_inputs, lambda g, x: make_boxed_func(g.forward))

            return aot_autograd(fw_compiler=forward, bw_compiler=backward)(gm, example_inputs)
        raise ValueError(f"compiler={compiler!r} is invalid: choose 'inductor' or 'aot_eager'.")

    return backend


def _uncached(compile_fx_inner: Callable, graph: fx.GraphModule, inputs: list, **kwargs: Any) -> Callable:
    """A backward part compiled without inductor's on-disk graph cache: a part's symbolic sizes
    come from the whole graph's inputs, which the cache's guards cannot name (seen: ``KeyError:
    'args'`` when a second process looked up a dynamic-shape part)."""
    from torch._inductor import config

    with config.patch(fx_graph_cache=False):
        return compile_fx_inner(graph, inputs, **kwargs)


def _split(graph: fx.GraphModule, inputs: list, inputs_of_forward: list, compile_part: Callable) -> SplitBackward:
    is_param = [isinstance(x, nn.Parameter) for x in inputs_of_forward]
    outputs = list(graph.graph.output_node().args[0])
    if len(outputs) != len(is_param):  # inputs AOTAutograd rearranged (aliases): not split, whole
        whole = compile_part(graph, inputs)
        return whole
    first = {i for i, p in enumerate(is_param) if not p}
    one, two, kept, boundary = split_backward_graph(graph, first)
    part_one = compile_part(one, inputs)
    part_two = compile_part(two, [inputs[i] for i in kept] + [n.meta["val"] for n in boundary])
    # The node's next edges are its tensor inputs' (sizes given as symbols have none).
    edge = [sum(isinstance(x, torch.Tensor) for x in inputs_of_forward[:i]) for i in range(len(is_param))]
    weight_edges = [edge[i] for i, p in enumerate(is_param) if p]
    return SplitBackward(part_one, part_two, [not p for p in is_param], weight_edges, kept)


_BACKENDS: dict = {}
#: ``compile=`` keys and the ``torch._dynamo.optimize`` arguments they become (``mode`` and
#: ``options`` go to the inductor backend itself).
_OPTIMIZE_ARGS = {"fullgraph": "nopython", "dynamic": "dynamic", "disable": "disable", "recompile_limit": "recompile_limit"}
COMPILE_KEYS = ("backend", "mode", "options", *_OPTIMIZE_ARGS)


def shared_backend(compiler: str, mode: Optional[str] = None, options: Optional[dict] = None,
                   split: bool = True) -> Callable:
    """One :func:`split_backend` per compiler and options for the process. torch keys compiled code
    on the backend object (its ``BACKEND_MATCH`` guard), and ``torch.compile`` / ``Module.compile``
    make a new one per call: every layer would recompile the graph its class already has, until
    torch's recompile limit sends the rest to eager. One object: twelve blocks, one compilation."""
    key = (compiler, mode, repr(sorted((options or {}).items())), split)
    if key not in _BACKENDS:
        _BACKENDS[key] = split_backend(compiler, mode, options, split)
    return _BACKENDS[key]


def compile_layer(layer: nn.Module, compiler: str = "inductor", split: bool = True, **options: Any) -> nn.Module:
    """Compile ``layer`` in place (its state-dict names stay) with the shared :func:`split_backend`
    of ``compiler`` (``split=False``: its backward whole); ``options``: ``mode``, ``options``
    (inductor's) and the keys of :data:`COMPILE_KEYS` that ``torch._dynamo.optimize`` takes
    (``fullgraph``, ``dynamic``, ...)."""
    if split:
        # B and W both read the backward's saved buffers (the graph is kept between them): torch
        # must not donate them to the backward. Its check runs at compile and at backward time, so
        # it is set for the process.
        import torch._functorch.config as functorch_config

        functorch_config.donated_buffer = False
    options = dict(options)
    backend = shared_backend(compiler, options.pop("mode", None), options.pop("options", None), split)
    compile_in_place(layer, backend, options)
    return layer


def compile_in_place(layer: nn.Module, backend: Any, options: dict) -> None:
    """Compile ``layer``'s forward in place, with ``backend`` itself as the backend object (see
    :func:`shared_backend`), for torch's own module classes too; records it :data:`~lightning_pp.runtime.process.COMPILED`."""
    optimize = torch._dynamo.optimize(backend, **{_OPTIMIZE_ARGS[k]: v for k, v in options.items()})
    # The forward is compiled, not ``_call_impl`` (what ``Module.compile`` compiles): module hooks
    # (FSDP2's, the pipeline's own timing) stay eager outside the graph, as with
    # ``torch.compile(module)``, instead of breaking it. torch's own module classes (nn.Linear,
    # nn.Sequential): dynamo skips their frames, which would leave them eager, silently; their
    # forward is compiled through a frame dynamo traces.
    # The class's function is compiled and bound to the layer, so a deep copy of the layer (EMA,
    # SWA) binds the copy: a compiled bound method would keep computing with the original's weights.
    function = type(layer).forward
    if torch._dynamo.trace_rules.check(layer.forward):
        from torch._dynamo.external_utils import wrap_inline

        function = wrap_inline(function)
    if fact(layer, CHECKPOINT, False):
        # Compiled after activation checkpointing is applied: the checkpoint is inside the graph
        # (dynamo traces it as a region whose activations the partitioner recomputes in the
        # backward), so the compiled backward recomputes fused kernels, and run_layer adds no
        # checkpoint of its own around the compiled layer.
        function = _checkpointed(function)
        facts(layer)[CHECKPOINT_COMPILED] = True
    layer.forward = types.MethodType(_marking_dynamic_dims(optimize(function)), layer)
    layer._compiled_call_impl = None  # a user's own layer.compile() is replaced by this one
    facts(layer)[COMPILED] = True


def _checkpointed(function: Callable) -> Callable:
    """``function`` (a layer's forward) under non-reentrant activation checkpointing."""
    from torch.utils.checkpoint import checkpoint

    def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(function, module, *args, use_reentrant=False, **kwargs)

    return forward


def _marking_dynamic_dims(compiled: Callable) -> Callable:
    """``compiled``, its inputs' batch and sequence dimensions marked dynamic (in eager code: torch
    forbids the mark inside a compiled frame) from the first call whose sizes differ from the
    first call's. A job whose shapes never change keeps static-shape kernels (measured: dynamic
    ones from the first step cost 5% of a compiled 1F1B step on this machine); one whose shapes
    change (a short last batch, a smaller last microbatch, a new sequence length, an expert's
    token count) compiles once more, then every size runs the symbolic graph."""
    state = {"first": None, "dynamic": False}

    def call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not state["dynamic"]:
            sizes = _batch_sequence_sizes(args)
            if state["first"] is None:
                state["first"] = sizes
            state["dynamic"] = sizes != state["first"]
        if state["dynamic"]:
            _mark_dynamic_dims(args)
        return compiled(module, *args, **kwargs)

    return call


def _batch_sequence_dims(arg: torch.Tensor) -> int:
    """How many leading dimensions of ``arg`` are batch and sequence: the first two, never a
    floating tensor's last (its features)."""
    return min(arg.dim() - arg.is_floating_point(), 2) if arg.dim() > 0 else 0


def _batch_sequence_sizes(args: tuple) -> tuple:
    return tuple(tuple(arg.shape[:_batch_sequence_dims(arg)]) for arg in args if isinstance(arg, torch.Tensor))


def _mark_dynamic_dims(args: tuple) -> None:
    """Mark the batch and sequence dimensions of the tensor inputs dynamic, which torch keeps
    symbolic unless the code fixes them (then it specialises, as without the mark; sizes 0 and 1
    always)."""
    for arg in args:
        if isinstance(arg, torch.Tensor):
            dims = _batch_sequence_dims(arg)
            if dims > 0:
                torch._dynamo.maybe_mark_dynamic(arg, list(range(dims)))


def compile_targets(layer: nn.Module) -> list[nn.Module]:
    """What compiling a pipeline layer compiles: the layer; for a layer that communicates inside
    (an expert-parallel MoE block, whose schedule-plan nodes call its parts between all-to-alls),
    its parts: each child module, and each expert this rank holds, so every compute node is
    compiled and every all-to-all stays outside. A layer whose parts are not its children (an
    adapter holding a whole foreign layer, as ``integrations.hf.HFMoEDecoderLayer``) names them with
    a ``compile_parts()`` method."""
    from lightning_pp.runtime.protocols import ProvidesScheduleNodes

    if not isinstance(layer, ProvidesScheduleNodes):
        return [layer]
    named = getattr(layer, "compile_parts", None)
    if callable(named):
        return list(named())
    parts = []
    for child in layer.children():
        children = list(child) if isinstance(child, nn.ModuleList) else [child]
        # an expert on another rank is a placeholder without parameters: nothing to compile
        parts.extend(c for c in children if any(True for _ in c.parameters()))
    return parts


def check_compile_option(value: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is a valid ``compile=`` (before any group exists)."""
    if isinstance(value, bool):
        return
    allowed = COMPILE_KEYS
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ValueError(f"compile={value!r} is invalid: pass False, True (inductor) or a dict of torch.compile "
                         f"keyword arguments, e.g. {{'mode': 'max-autotune'}} or {{'backend': 'aot_eager'}}.")
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise ValueError(f"compile={dict(value)!r}: {', '.join(unknown)} is not one of the torch.compile keyword "
                         f"arguments the pipeline passes on: {', '.join(allowed)}.")
    if value.get("mode") is not None and value.get("options"):
        raise ValueError(f"compile={dict(value)!r}: give mode or options, not both (torch.compile's rule).")
    backend = value.get("backend") or "inductor"
    if (value.get("mode") is not None or value.get("options")) and backend != "inductor":
        raise ValueError(f"compile={dict(value)!r}: mode and options are inductor's; the backend {backend!r} takes "
                         f"neither. Drop them, or use backend='inductor'.")


def _user_compiled(layer: nn.Module) -> bool:
    return isinstance(layer, torch._dynamo.eval_frame.OptimizedModule) or getattr(layer, "_compiled_call_impl", None) is not None


def compile_pipeline_layers(layers: Sequence[nn.Module], option: CompileOption, splits_backward: bool) -> None:
    """``compile=``: compile this rank's pipeline layers in place (after the cut, materialisation and
    sharding). A layer the user compiled (``torch.compile(layer)`` or ``layer.compile()``) is
    recompiled with the split backend under a zero-bubble schedule (``splits_backward``), so its
    ``W`` does not run its backward twice; elsewhere it runs as the user compiled it."""
    if option is False and not (splits_backward and any(map(_user_compiled, layers))):
        return
    kwargs = dict(option) if isinstance(option, Mapping) else {}
    backend = kwargs.pop("backend", None) or "inductor"
    if not isinstance(backend, str) or backend not in SPLIT_COMPILERS:
        if splits_backward:
            log.warning(f"lightning_pp: compile backend {backend!r} is not one whose backward lightning_pp splits "
                        f"({', '.join(SPLIT_COMPILERS)}): under the zero-bubble schedule each compiled layer's W "
                        f"runs its whole backward again.")
        kwargs.pop("mode", None), kwargs.pop("options", None)  # None here (check_compile_option)
        for layer in layers:
            for part in compile_targets(layer):
                compile_in_place(part, backend, kwargs)
            facts(layer)[COMPILED] = True
        return
    for layer in layers:
        if option is False and not _user_compiled(layer):
            continue
        target = layer
        if isinstance(layer, torch._dynamo.eval_frame.OptimizedModule):  # call through to the in-place compiled module
            target = layer._orig_mod
            layer.forward = target.__call__
        for part in compile_targets(target):
            compile_layer(part, backend, split=splits_backward, **kwargs)
        facts(layer)[COMPILED] = True
    if option is False:
        log.info("lightning_pp: layers compiled with torch.compile were recompiled with lightning_pp's split backend "
                 "(inductor), so the zero-bubble W computes only their weight gradients.")

"""Compiled pipeline layers whose backward splits for the zero-bubble schedules (issue 23, first part).

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
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import fx, nn


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
        kept = getattr(node, "_lpp_weight_half", None)
        if kept is not None:  # the W restarting from this node: the weight gradients from what B kept
            node._lpp_weight_half = None
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
            node._lpp_weight_half = saved + boundary
            return grads
        rest = self.second(saved + boundary)
        return [g if is_input else w for g, w, is_input in zip(grads, rest, self.is_input)]


def split_backend(compiler: str = "inductor") -> Callable:
    """A ``torch.compile`` backend whose backward graphs split into input- and weight-gradient
    parts (``compiler``: ``"inductor"`` or ``"aot_eager"``, which keeps torch's eager kernels and
    their order of operations)."""

    def backend(gm: fx.GraphModule, example_inputs: list):
        if compiler == "inductor":
            from torch._inductor.compile_fx import compile_fx, compile_fx_inner

            def inner(graph, inputs, **kwargs):
                if not kwargs.get("is_backward"):
                    return compile_fx_inner(graph, inputs, **kwargs)
                kwargs.pop("static_input_idxs", None)  # indices of the whole graph's inputs
                return _split(graph, inputs, example_inputs, lambda g, x: compile_fx_inner(g, x, **kwargs))

            return compile_fx(gm, example_inputs, inner_compile=inner)
        if compiler == "aot_eager":
            from functorch.compile import make_boxed_func
            from torch._dynamo.backends.common import aot_autograd

            def forward(graph, inputs):
                return make_boxed_func(graph.forward)

            def backward(graph, inputs):
                return _split(graph, inputs, example_inputs, lambda g, x: make_boxed_func(g.forward))

            return aot_autograd(fw_compiler=forward, bw_compiler=backward)(gm, example_inputs)
        raise ValueError(f"compiler={compiler!r} is invalid: choose 'inductor' or 'aot_eager'.")

    return backend


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


def compile_layer(layer: nn.Module, compiler: str = "inductor", **options: Any) -> nn.Module:
    """Compile ``layer`` in place (``Module.compile``: its state-dict names stay) with
    :func:`split_backend`; ``options`` are ``torch.compile``'s other keyword arguments."""
    # B and W both read the backward's saved buffers (the graph is kept between them): torch must
    # not donate them to the backward. Its check runs at compile and at backward time, so it is set
    # for the process.
    import torch._functorch.config as functorch_config

    functorch_config.donated_buffer = False
    layer.compile(backend=split_backend(compiler), **options)
    return layer

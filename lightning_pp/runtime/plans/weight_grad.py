"""The zero-bubble split of a backward: the input gradient now (``B``), the weight gradient later
(``W``), together exactly the gradients of one backward.

A stage's backward graph has two kinds of work. The *input path* is every autograd node from which
a stage input (a received activation) can be reached: it must run before the input gradient can
be sent to the previous stage. Everything else hanging off that path leads only to parameters: it
can wait. For each node of the input path with an edge into a parameter-only part (a matmul whose
other operand is a weight, a layer norm's affine...) we remember the gradient that flowed into it
while the input gradient was computed; the ``W`` action later restarts autograd from exactly those
nodes and those gradients, asking only for the parameters. The same idea as in torch's pipelining
(``stage_backward_input`` / ``stage_backward_weight``) and the paper's implementation.

Details that keep it exact:

* Parameters are grouped by the input-path nodes they hang off (a weight used twice joins its two
  uses into one group). Each group is one autograd call; where a group has several such nodes and
  one lies downstream of another, a pre-hook pins each node's incoming gradient to the remembered
  one, so nothing flows in twice.
* Gradients are accumulated into ``.grad`` by autograd itself, as a plain backward would (gradient
  hooks fire at W); a parameter no path reaches keeps ``grad = None``.
* A stage whose inputs need no gradient (the first stage) has no input path: ``B`` does nothing
  and ``W`` is the whole backward.
* A chunk run through a schedule plan (combined steps, DualPipeV with MoE layers) is a chain of
  nodes, each its own autograd segment: while its backward runs with the microbatch context's
  ``deferred_weights`` set, every compute node splits its own segment the same way
  (:class:`DeferredWeights`), and the ``W`` runs the nodes' weight halves in the order their
  backwards ran.
* Activation-checkpointed layers recompute their forward once per autograd call that needs it, so
  with (non-reentrant) checkpointing a ``W`` reaching into such a layer recomputes it again
  (exact, slower). Reentrant checkpointing (``use_reentrant=True``) refuses an autograd call that
  asks for particular inputs; a backward through such a layer runs whole at ``B`` (its ``W`` then
  has nothing left to do): exact, without the deferral.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from lightning_pp.runtime import context


_REENTRANT_CHECKPOINT = "CheckpointFunctionBackward"  # torch.utils.checkpoint(use_reentrant=True)


_ENGINE = torch.autograd.Variable._execution_engine


def engine_backward(roots: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]],
                    inputs: Sequence[torch.Tensor] = (), keep_graph: bool = False):
    """Autograd from ``roots`` through the engine directly, as ``torch.autograd.backward`` does
    after checking its arguments. The runtime's one way into autograd: it runs for every
    (microbatch, chunk) and every schedule-plan node, so the checks' cost would show. A root is a
    tensor or an autograd edge (``GradientEdge``: what the stage keeps of an output it sent, see
    ``stage.kept_for_backward``), which the engine takes alike. With ``inputs``, returns their
    gradients instead of accumulating into ``.grad``."""
    return _ENGINE.run_backward(tuple(roots), tuple(grads), keep_graph, False, tuple(inputs), True, not inputs)


def _root_edge(root) -> tuple[Optional[Node], int]:
    """(node, output number) a root's gradient enters: a tensor's ``grad_fn`` (``None`` for a
    leaf), or an autograd edge's own."""
    if isinstance(root, GradientEdge):
        return root.node, root.output_nr
    return root.grad_fn, root.output_nr


def _graph(roots: Sequence) -> dict[Node, list[Node]]:
    """Every node reachable from ``roots``, with the nodes that feed it a gradient (its parents)."""
    parents: dict[Node, list[Node]] = {}
    stack = [node for node, _ in map(_root_edge, roots) if node is not None]
    for node in stack:
        parents.setdefault(node, [])
    while stack:
        node = stack.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                stack.append(child)
            parents[child].append(node)
    return parents


def _upward(starts: Sequence[Node], parents: dict[Node, list[Node]], stop: Optional[set] = None):
    """Nodes reached from ``starts`` towards the roots; with ``stop``, the walk does not pass those
    nodes and returns (walked, stop nodes met)."""
    seen, met, stack = set(starts), set(), list(starts)
    while stack:
        node = stack.pop()
        for parent in parents.get(node, ()):
            if stop is not None and parent in stop:
                met.add(parent)
            elif parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen, met


class WeightGrad:
    """The deferred half of one backward: :meth:`run` accumulates the weight gradients."""

    def __init__(self, groups: list, roots: tuple = (), grads: tuple = ()) -> None:
        # [(params, seeds [(node, output index, gradient)], pins [(node, its remembered gradients)])]
        self.groups = groups
        self.roots, self.grads = roots, grads  # the whole backward (no input path), else ()

    def run(self) -> None:
        if self.roots:
            engine_backward(self.roots, self.grads)
        for params, seeds, pins in self.groups:
            if not seeds:
                continue
            # A node downstream of another of the group gets exactly its remembered gradient.
            handles = [node.register_prehook(lambda _incoming, grads=grads: grads) for node, grads in pins] \
                if len({node for node, _, _ in seeds}) > 1 else []
            try:  # accumulated by autograd itself, so .grad and gradient hooks behave as in one backward
                torch.autograd.backward([GradientEdge(node, i) for node, i, _ in seeds], [g for _, _, g in seeds],
                                        retain_graph=True, inputs=params)
            finally:
                for handle in handles:
                    handle.remove()
        self.groups, self.roots, self.grads = [], (), ()


def backward_input(roots: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]],
                   inputs: Sequence[torch.Tensor], params: Sequence[torch.Tensor]):
    """Compute the gradients of ``inputs`` (leaves) only; returns them (``None`` where no path
    leads) and the :class:`WeightGrad` that later accumulates the ``params``' gradients."""
    roots, grads = tuple(roots), tuple(grads)
    inputs = [t for t in inputs if t.requires_grad]
    if not roots:
        return (), WeightGrad([])
    if not inputs:
        return (), WeightGrad([], roots, grads)
    parents = _graph(roots)
    if any(node.name() == _REENTRANT_CHECKPOINT for node in parents):
        engine_backward(roots, grads)
        return tuple(t.grad for t in inputs), WeightGrad([])
    input_nodes = [get_gradient_edge(t).node for t in inputs]
    input_path, _ = _upward([n for n in input_nodes if n in parents], parents)
    # A root that no input feeds (an output that depends on parameters only) is weight work whole:
    # it is a starting point of its own, seeded with its gradient.
    root_seeds: dict[Node, list] = {}
    for r, g in zip(roots, grads):
        node, output_nr = _root_edge(r)
        if node is not None and node not in input_path and g is not None:
            root_seeds.setdefault(node, []).append((output_nr, g))
    groups = _param_groups([p for p in params if p.requires_grad], parents, input_path | set(root_seeds))
    captured: dict[Node, tuple] = {}
    hooks = []
    for _, boundary in groups:
        for node in boundary:
            if node in input_path:
                hooks.append(node.register_prehook(lambda incoming, node=node: captured.__setitem__(node, incoming)))
    try:
        in_grads = engine_backward(roots, grads, inputs, keep_graph=True)
    finally:
        for hook in hooks:
            hook.remove()
    work = []
    for members, boundary in groups:
        seeds = [(node, i, g) for node in boundary if node in captured
                 for i, g in enumerate(captured[node]) if g is not None]
        seeds += [(node, i, g) for node in boundary if node in root_seeds for i, g in root_seeds[node]]
        pins = [(node, captured[node]) for node in boundary if node in captured]
        work.append((members, seeds, pins))
    return tuple(in_grads), WeightGrad(work)


class DeferredWeights:
    """The deferred weight gradients of one (microbatch, chunk): its backward asks
    :meth:`input_grads` for the inputs' gradients instead of running whole (once for a plain
    chunk; once per compute node for a chunk run through its schedule plan); :meth:`run` (the
    ``W`` action) then accumulates the weights' gradients, segment by segment in the order their
    backwards ran (the order of one backward)."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.parts: list[WeightGrad] = []

    def input_grads(self, roots: Sequence[torch.Tensor], grads: Sequence[Optional[torch.Tensor]],
                    inputs: Sequence) -> tuple:
        """The gradients of a node's ``inputs`` (``None`` for non-tensors and where none flows);
        the node's weight half is kept for :meth:`run`."""
        leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
        needed, work = backward_input(roots, grads, leaves, self.params)
        self.parts.append(work)
        it = iter(needed)
        return tuple(next(it, None) if isinstance(t, torch.Tensor) and t.requires_grad else None for t in inputs)

    def run(self) -> None:
        parts, self.parts = self.parts, []
        for part in parts:
            part.run()


def deferred_weights() -> Optional[DeferredWeights]:
    """Where plan nodes leave their weight halves now (the microbatch context's, set by the
    executor for a split backward), or ``None`` (whole backwards)."""
    return context.current().deferred_weights


def _param_groups(params: list, parents: dict[Node, list[Node]], input_path: set) -> list:
    """[(params, boundary nodes)]: parameters joined when they hang off a common input-path node."""
    boundary_of: dict[int, set] = {}
    for index, p in enumerate(params):
        node = get_gradient_edge(p).node
        if node not in parents:
            continue  # not used by this backward: its grad stays as it is
        _, met = _upward([node], parents, stop=input_path)
        if met:
            boundary_of[index] = met
    # Union parameters that share a boundary node.
    group_of_node: dict[Node, int] = {}
    leader = list(range(len(params)))

    def find(i: int) -> int:
        while leader[i] != i:
            leader[i] = leader[leader[i]]
            i = leader[i]
        return i

    for index, met in boundary_of.items():
        for node in met:
            if node in group_of_node:
                leader[find(index)] = find(group_of_node[node])
            else:
                group_of_node[node] = index
    groups: dict[int, tuple[list, set]] = {}
    for index, met in boundary_of.items():
        members, nodes = groups.setdefault(find(index), ([], set()))
        members.append(params[index])
        nodes.update(met)
    return [(members, list(nodes)) for members, nodes in groups.values()]

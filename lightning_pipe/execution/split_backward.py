"""A stage's backward in two halves: the gradient of its input first, its weights' gradients later.

The previous stage waits for the input gradient; nobody waits for the weight gradients. Computing the input
gradient first (``backward_input``) and the weight gradients afterwards (:meth:`WeightGradients.compute`) lets the
previous stage start sooner: GPipe's drain and 1F1B's cool-down shrink, and zero-bubble schedules fill their idle
ticks with weight gradients.

Nothing is computed twice. ``torch.autograd.grad`` with respect to the inputs runs only the nodes on the paths from
the outputs to the inputs, and in each only the gradients those paths need (a linear layer's node computes the
gradient of its input, not of its weight). The nodes where a weight's path leaves the input path (the
*intermediates*: that linear layer's node) remember the gradient that reached them; the weight half starts there,
once per group of weights that share intermediates, and runs only the weights' branches::

    output ── node C ── node B ── node A ── input          input half: C, B, A (their input gradients only)
                 │         │         │
                 W_C       W_B       W_A                    weight half: from C, B, A with their stashed gradients

A forward re-computed by ``torch.utils.checkpoint`` cannot be split this way: each backward call re-computes it
again. The engine re-runs such a forward itself before the input half (see :mod:`lightning_pipe.execution.engine`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class WeightGradients:
    """The weight half of a split backward: for each group of weights, the edges and gradients it starts from."""

    groups: list[tuple[list[GradientEdge], list[Tensor], list[Tensor]]] = field(default_factory=list)

    def compute(self) -> None:
        """Accumulate every weight's gradient into its ``.grad``, as ``backward()`` would; frees the graph."""
        for edges, grads, weights in self.groups:
            _accumulate(weights, torch.autograd.grad(edges, weights, grads, allow_unused=True))
        self.groups = []


def backward_input(
    outputs: Sequence[Tensor | GradientEdge],
    grad_outputs: Sequence[Tensor],
    inputs: Sequence[Tensor],
    weights: Sequence[Tensor],
) -> tuple[tuple[Tensor | None, ...], WeightGradients]:
    """The gradients of ``inputs`` (leaves; ``None`` where the outputs do not reach one), and what the weight half
    needs. The graph is kept until :meth:`WeightGradients.compute` has run."""
    output_edges = [_edge(output) for output in outputs]
    graph = _Graph([edge.node for edge in output_edges])
    on_input_path = graph.reaching({get_gradient_edge(t).node for t in inputs})
    # A weight whose branch meets an output off the input path starts there too, with the output's gradient; the
    # branch goes on up from it, as the output may also feed the chunk's later blocks (T5's position bias: carried
    # out, and added in every later block), whose share reaches it only through the nodes further up.
    outputs_off_path = {edge.node for edge in output_edges} - on_input_path
    reached = [w for w in weights if w.requires_grad and get_gradient_edge(w).node in graph.parents]
    intermediates = {
        id(w): graph.where_paths_leave(get_gradient_edge(w).node, on_input_path, outputs_off_path) for w in reached
    }
    groups: list[tuple[set[Node], list[Tensor]]] = []
    now: list[Tensor] = []
    for nodes, members in _groups(reached, intermediates):
        # A group whose weight half would run along the input path (a weight used at two depths of it) cannot be
        # deferred without counting a gradient twice: its gradients come with the input half.
        if graph.any_reaches_another(nodes, on_input_path):
            now += members
        else:
            groups.append((nodes, members))
    stashed: dict[Node, tuple[Tensor | None, ...]] = {}
    for edge, grad in zip(output_edges, grad_outputs):
        if edge.node not in on_input_path:
            grads_in = list(stashed.get(edge.node, (None,) * (edge.output_nr + 1)))
            grads_in += [None] * (edge.output_nr + 1 - len(grads_in))
            grads_in[edge.output_nr] = grad
            stashed[edge.node] = tuple(grads_in)
    handles = [
        node.register_prehook(lambda grads, node=node: stashed.__setitem__(node, grads))
        for nodes, _ in groups for node in nodes & on_input_path
    ]
    try:
        grads: tuple[Tensor | None, ...] = ()
        if inputs or now:
            grads = torch.autograd.grad(
                output_edges, [*inputs, *now], grad_outputs, retain_graph=True, allow_unused=True
            )
    finally:
        for handle in handles:
            handle.remove()
    _accumulate(now, grads[len(inputs):])
    return grads[: len(inputs)], WeightGradients(_starting_points(groups, stashed))


def _groups(weights: list[Tensor], intermediates: dict[int, set[Node]]) -> list[tuple[set[Node], list[Tensor]]]:
    """Weights whose intermediates overlap form one group (a linear layer's weight and bias): one backward call each,
    so that no call runs another group's nodes again."""
    merged: list[tuple[set[Node], list[Tensor]]] = []
    for weight in weights:
        nodes, members = set(intermediates[id(weight)]), [weight]
        for group in [group for group in merged if group[0] & nodes]:
            merged.remove(group)
            nodes |= group[0]
            members += group[1]
        merged.append((nodes, members))
    return merged


def _starting_points(
    groups: list[tuple[set[Node], list[Tensor]]], stashed: dict[Node, tuple[Tensor | None, ...]]
) -> list[tuple[list[GradientEdge], list[Tensor], list[Tensor]]]:
    """Each group's intermediates as edges with the gradients stashed there."""
    starts = []
    for nodes, members in groups:
        edges, grads = [], []
        for node in nodes:
            for position, grad in enumerate(stashed.get(node, ())):
                if grad is not None:
                    edges.append(GradientEdge(node, position))
                    grads.append(grad)
        if edges:
            starts.append((edges, grads, members))
    return starts


def _accumulate(weights: Sequence[Tensor], grads: Sequence[Tensor | None]) -> None:
    """Add ``grads`` into the weights' ``.grad``, as autograd's accumulation does."""
    for weight, grad in zip(weights, grads):
        if grad is None:
            continue
        if weight.grad is None:
            weight.grad = grad
        else:
            weight.grad += grad


class _Graph:
    """The autograd graph below some output nodes, with each node's parents (the nodes that feed it gradients)."""

    def __init__(self, output_nodes: list[Node]) -> None:
        self.parents: dict[Node, list[Node]] = {}
        self.order: list[Node] = []  # every node after all its parents
        stack = [(node, False) for node in output_nodes if node is not None]
        seen: set[Node] = set()
        while stack:  # depth-first, post-order: a node is appended once all its children are
            node, expanded = stack.pop()
            if expanded:
                self.order.append(node)
                continue
            if node in seen:
                continue
            seen.add(node)
            self.parents.setdefault(node, [])
            stack.append((node, True))
            for child, _ in node.next_functions:
                if child is not None:
                    self.parents.setdefault(child, []).append(node)
                    stack.append((child, False))
        self.order.reverse()

    def reaching(self, targets: set[Node]) -> set[Node]:
        """The nodes with a path to one of ``targets`` (the targets included)."""
        found = set(targets) & set(self.parents)
        for node in reversed(self.order):  # children before parents
            if node not in found and any(child in found for child, _ in node.next_functions if child is not None):
                found.add(node)
        return found

    def any_reaches_another(self, nodes: set[Node], within: set[Node]) -> bool:
        """Whether a path through ``within`` leads from one of ``nodes`` to another."""
        for start in nodes:
            stack, seen = [child for child, _ in start.next_functions if child in within], set()
            while stack:
                node = stack.pop()
                if node in nodes:
                    return True
                if node not in seen:
                    seen.add(node)
                    stack.extend(child for child, _ in node.next_functions if child in within)
        return False

    def where_paths_leave(self, weight_node: Node, stops: set[Node], passed: set[Node]) -> set[Node]:
        """The first nodes of ``stops`` met going up from ``weight_node`` (each path up ends at the first), and the
        nodes of ``passed`` met on the way (a path goes on up through them)."""
        leaving, stack, seen = set(), [weight_node], set()
        while stack:
            node = stack.pop()
            if node in seen:
                continue
            seen.add(node)
            for parent in self.parents.get(node, []):
                if parent in stops:
                    leaving.add(parent)
                else:
                    if parent in passed:
                        leaving.add(parent)
                    stack.append(parent)
        return leaving


def _edge(output: Tensor | GradientEdge) -> GradientEdge:
    return output if isinstance(output, GradientEdge) else get_gradient_edge(output)

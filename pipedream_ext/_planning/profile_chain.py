"""A ``graph.txt`` profile as the chain of layers the configuration search cuts:
``chain_of_profile`` (``plan --auto``).

The search (``configuration.search``) cuts a chain. A profile of an ``nn.Sequential``
is one; any other profile (a traced model's groups, PipeDream's own profiles of
ResNet, Inception, GNMT...) is a DAG, which becomes a chain in topological order
(ties in file order), as ``graph_split`` cuts a traced model: a cut after position
``i`` sends every value made at or before ``i`` and used after it, so a layer's
output bytes are the bytes crossing the cut after it (skip connections and branches
included) and its input bytes those crossing the cut before it. An input node joins
the layer of its first consumer.

A DAG of more than ``max_layers`` nodes is merged into that many layers of
consecutive nodes: boundaries near equal shares of the compute, each moved within its
neighbourhood to where the fewest bytes cross (a block's end rather than its middle).
The search is exact over the merged chain; cuts inside a merged layer are not tried.

Times and bytes are per sample (no fixed part: one profiled size cannot tell it); what
a layer keeps for its backward is taken as its own output.
"""
from __future__ import annotations

import dataclasses
import heapq
from typing import Any, Dict, List, Mapping, Optional, Sequence

from ..configuration import LayerCost
from .layer_costs import LayerCosts, balance_bounds

__all__ = ["MAX_LAYERS", "ProfileChain", "chain_of_profile"]

#: The most layers a branching profile is merged into by default: the search's time
#: grows fast with layers when a pipeline's virtual stages approach them.
MAX_LAYERS = 32


@dataclasses.dataclass
class ProfileChain:
    """A profile as a chain.

    Attributes:
        costs: one cost per layer, chain order.
        nodes: for a branching profile, the profile's node ids each layer stands for
            (inputs included: what a plan's stage lists); ``None`` for a chain profile
            (layer ``i`` is the ``nn.Sequential``'s child ``i``).
    """

    costs: LayerCosts
    nodes: Optional[List[List[str]]]

    def stage_nodes(self, balance: Sequence[int]) -> List[List[str]]:
        """The node ids each stage of ``balance`` holds (a branching profile only)."""
        assert self.nodes is not None, "a chain profile's stages hold layer ranges"
        bounds = balance_bounds(balance, len(self.nodes))
        return [[n for layer in self.nodes[lo:hi] for n in layer] for lo, hi in zip(bounds, bounds[1:])]


def _topological(ids: Sequence[str], after: Mapping[str, List[str]],
                 before: Mapping[str, List[str]]) -> List[str]:
    """Kahn's order, ties broken by file position.

    Raises:
        ValueError: the graph has a cycle.
    """
    position = {n: i for i, n in enumerate(ids)}
    missing = {n: len(before.get(n, [])) for n in ids}
    ready = [(position[n], n) for n in ids if missing[n] == 0]
    heapq.heapify(ready)
    order: List[str] = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for m in after.get(n, []):
            missing[m] -= 1
            if missing[m] == 0:
                heapq.heappush(ready, (position[m], m))
    if len(order) != len(ids):
        stuck = sorted((n for n in ids if missing[n] > 0), key=position.__getitem__)[:5]
        raise ValueError(f"the profile's graph has a cycle through {stuck}; a profile is a DAG")
    return order


def _crossing(order: Sequence[str], after: Mapping[str, List[str]],
              size: Mapping[str, float]) -> List[float]:
    """``out[i]``: bytes of the values made at or before position ``i`` and used after it."""
    position = {n: i for i, n in enumerate(order)}
    delta = [0.0] * (len(order) + 1)
    for n in order:
        last = max((position[m] for m in after.get(n, [])), default=position[n])
        delta[position[n]] += size[n]
        delta[last] -= size[n]
    out, live = [], 0.0
    for i in range(len(order)):
        live += delta[i]
        out.append(live)
    return out


def _boundaries(work: Sequence[float], crossing: Sequence[float], groups: int) -> List[int]:
    """Group starts (``0`` first) of ``groups`` runs of consecutive positions."""
    n = len(work)
    total = sum(work) or 1.0
    prefix = [0.0]
    for w in work:
        prefix.append(prefix[-1] + w)
    starts, width = [0], n / groups
    for g in range(1, groups):
        ideal = next((i for i in range(1, n) if prefix[i] >= total * g / groups), n - 1)
        first, last = starts[-1] + 1, n - (groups - g)  # room for the groups left
        low = min(max(ideal - int(width / 2), first), last)
        high = min(max(ideal + int(width / 2), low), last)
        # A start at i cuts after position i - 1.
        starts.append(min(range(low, high + 1), key=lambda i: (crossing[i - 1], abs(i - ideal))))
    return starts


def chain_of_profile(graph: Any, batch_size: int, max_layers: int = MAX_LAYERS) -> ProfileChain:
    """The chain of a profile (module docstring), profiled at ``batch_size`` samples.

    Args:
        graph: a loaded profile (``planner.load_profile``).
        batch_size: the samples per step the profile was taken with.
        max_layers: merge a branching profile into at most this many layers.

    Returns:
        The chain and, for a branching profile, the nodes of each layer.

    Raises:
        ValueError: ``batch_size`` or ``max_layers`` below 1, a cycle, or no computing node.
    """
    if batch_size < 1:
        raise ValueError(f"--batch-size {batch_size}: the samples the profile was taken with, >= 1")
    if max_layers < 1:
        raise ValueError(f"max_layers={max_layers} must be >= 1")
    nodes: Dict[str, Mapping[str, Any]] = {n["id"]: n for n in graph.nodes()}
    after: Dict[str, List[str]] = {}
    before: Dict[str, List[str]] = {}
    for a, b in graph.edges():
        after.setdefault(a, []).append(b)
        before.setdefault(b, []).append(a)
    branching = not graph.is_chain()
    order = _topological(list(nodes), after, before)
    position = {n: i for i, n in enumerate(order)}
    # An input sits just before its first consumer (its bytes cross from there on).
    placed = sorted(order, key=lambda n: min((position[m] for m in after.get(n, [])),
                                             default=position[n]) - 0.5
                    if nodes[n]["is_input"] else position[n])
    members: List[List[str]] = []
    starts: List[int] = []  # each layer's first position in ``placed``
    pending: List[str] = []
    for i, n in enumerate(placed):
        if nodes[n]["is_input"]:
            pending.append(n)
            continue
        starts.append(i - len(pending))
        members.append(pending + [n])
        pending = []
    if not members:
        raise ValueError("the profile has no computing node (only inputs)")
    members[-1] += pending  # inputs nothing uses
    size = {n: float(nodes[n]["activation_bytes"]) for n in placed}
    cross = _crossing(placed, after, size)
    fed = [sum(size[n] for n in m if nodes[n]["is_input"]) for m in members]
    in_bytes = [(cross[s - 1] if s > 0 else 0.0) + f for s, f in zip(starts, fed)]
    computing = [next(n for n in m if not nodes[n]["is_input"]) for m in members]
    # The last layer's output goes to the loss, crossing no cut: its own bytes.
    out_bytes = [cross[s - 1] for s in starts[1:]] + [size[computing[-1]]]
    return _merged(nodes, computing, members, in_bytes, out_bytes, batch_size,
                   max_layers if branching else len(computing), branching)


def _merged(nodes: Mapping[str, Mapping[str, Any]], computing: Sequence[str],
            members: Sequence[List[str]], in_bytes: Sequence[float], out_bytes: Sequence[float],
            batch: int, groups: int, branching: bool) -> ProfileChain:
    """The chain's layers, consecutive ones merged into at most ``groups``."""
    work = [float(nodes[n]["forward_ms"]) + float(nodes[n]["backward_ms"]) for n in computing]
    starts = list(range(len(computing))) if len(computing) <= groups else \
        _boundaries(work, out_bytes, groups)
    layers, names, node_lists = [], [], []
    for lo, hi in zip(starts, starts[1:] + [len(computing)]):
        part = [nodes[n] for n in computing[lo:hi]]
        layers.append(LayerCost(
            forward_per_sample=sum(float(n["forward_ms"]) for n in part) / 1e3 / batch,
            backward_per_sample=sum(float(n["backward_ms"]) for n in part) / 1e3 / batch,
            output_bytes_per_sample=out_bytes[hi - 1] / batch,
            stash_bytes_per_sample=sum(float(n["activation_bytes"]) for n in part) / batch,
            input_bytes_per_sample=in_bytes[lo] / batch,
            parameter_bytes=sum(float(n["parameter_bytes"]) for n in part)))
        names.append(str(part[0]["description"]) if hi - lo == 1 else
                     f"{computing[lo]}..{computing[hi - 1]} ({hi - lo} nodes)")
        node_lists.append([n for m in members[lo:hi] for n in m])
    return ProfileChain(LayerCosts(layers, names, None, [batch]), node_lists if branching else None)

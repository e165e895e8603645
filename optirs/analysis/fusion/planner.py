"""The fusion planner: partitions a :class:`FusionGraph` into groups, one kernel each.

:class:`FusionPlanner` partitions the graph into :class:`FusionGroup` s, minimizing the bytes
moved through memory under the rules that :meth:`FusionPlan.validate` checks (see docs/fusion.md).
The cost model: a group reads each distinct external value it uses once (at the value's own size,
so a broadcast scalar costs its itemsize) and writes each value it produces that is a graph output
or is used by another group; constants cost nothing.

Exact minimization is NP-hard in general, so graphs of at most ``exact_limit`` ops (12 by
default) get an exact branch-and-bound search over all partitions, and larger graphs a greedy
pairwise merge (largest saving first); ``FusionPlan.optimal`` says which one answered.

``plan.compile(backend)`` asks the bound backend (its ``fusion`` capability) to compile one
kernel per group from the source the ``fusion`` analysis plugin generates, and
``plan.run(inputs, backend)`` executes the graph: numpy arrays in, numpy arrays out (see
:mod:`optirs.analysis.fusion.execution`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from optirs.core.errors import InvalidParameterError
from optirs.analysis.fusion.execution import CompiledPlan
from optirs.analysis.fusion.graph import FusionGraph, OpKind, Shape
from optirs.plugin.registry import Backend

__all__ = ["FusionGroup", "FusionPlan", "FusionPlanner"]


# ================================================================ plans


@dataclass(frozen=True)
class FusionGroup:
    """One group of a plan: one kernel.

    ``inputs`` are the external values it reads (each once), ``outputs`` the values it writes
    (graph outputs and values other groups use). ``bytes_before`` is what its ops would move
    unfused (one kernel each), ``bytes_after`` what the fused kernel moves.
    """

    index: int
    ops: Tuple[str, ...]
    inputs: Tuple[str, ...]
    outputs: Tuple[str, ...]
    domain: Optional[Shape]
    reduce_axes: Optional[Tuple[int, ...]]
    opaque: bool
    bytes_read: int
    bytes_written: int
    bytes_before: int

    @property
    def bytes_after(self) -> int:
        return self.bytes_read + self.bytes_written

    def __len__(self) -> int:
        return len(self.ops)


class _Index:
    """The graph as integers and bitsets, shared by the planner and ``validate``."""

    def __init__(self, graph: FusionGraph):
        self.graph = graph
        self.ops = graph.ops
        self.n = len(self.ops)
        self.pos = {op.name: i for i, op in enumerate(self.ops)}
        self.outputs = set(graph.outputs)
        # operands as value names; producers as op indices (graph inputs have none)
        self.operands = [tuple(dict.fromkeys(op.operand_names())) for op in self.ops]
        self.preds = [tuple(sorted({self.pos[v] for v in ops if v in self.pos})) for ops in self.operands]
        self.succs: List[List[int]] = [[] for _ in range(self.n)]
        for i, ps in enumerate(self.preds):
            for p in ps:
                self.succs[p].append(i)
        self.desc = [0] * self.n  # strict descendants, bitset
        for i in reversed(range(self.n)):
            m = 0
            for s in self.succs[i]:
                m |= (1 << s) | self.desc[s]
            self.desc[i] = m
        self.anc = [0] * self.n
        for i in range(self.n):
            m = 0
            for p in self.preds[i]:
                m |= (1 << p) | self.anc[p]
            self.anc[i] = m
        self.kind = [op.kind for op in self.ops]
        self.domain = [self._domain(op) for op in self.ops]
        self.axes = [self._axes(op) for op in self.ops]
        self.value_bytes = {n: graph.nbytes(n) for n in list(graph.inputs) + [op.name for op in self.ops]}
        self.out_bytes = [self.value_bytes[op.name] for op in self.ops]
        self.singleton_cost = [self.cost(1 << i) for i in range(self.n)]

    def _domain(self, op: FusionOp) -> Optional[Shape]:
        if op.kind is OpKind.OPAQUE:
            return None
        if op.kind is OpKind.REDUCTION:
            return self.graph.shape(op.inputs[0])
        return op.shape

    def _axes(self, op: FusionOp) -> Optional[Tuple[int, ...]]:
        if op.kind is not OpKind.REDUCTION:
            return None
        nd = len(self.graph.shape(op.inputs[0]))
        return tuple(range(nd)) if op.axis is None else (op.axis,)

    @staticmethod
    def members(mask: int) -> List[int]:
        out = []
        while mask:
            low = mask & -mask
            out.append(low.bit_length() - 1)
            mask ^= low
        return out

    def io(self, mask: int) -> Tuple[List[str], List[str]]:
        """(external values read, values written) of a group, in first-use / op order."""
        reads: Dict[str, None] = {}
        writes: List[str] = []
        for i in self.members(mask):
            for v in self.operands[i]:
                p = self.pos.get(v)
                if p is None or not (mask >> p) & 1:
                    reads[v] = None
            name = self.ops[i].name
            if name in self.outputs or any(not (mask >> s) & 1 for s in self.succs[i]):
                writes.append(name)
        return list(reads), writes

    def cost(self, mask: int) -> int:
        reads, writes = self.io(mask)
        return sum(self.value_bytes[v] for v in reads) + sum(self.value_bytes[v] for v in writes)

    def group_problems(self, mask: int, cap: int) -> List[str]:
        """Why a set of ops cannot be one group (empty when it can)."""
        ms = self.members(mask)
        names = [self.ops[i].name for i in ms]
        probs = []
        if len(ms) > cap:
            probs.append(f"{len(ms)} ops exceed the size cap {cap}")
        if len(ms) > 1 and any(self.kind[i] is OpKind.OPAQUE for i in ms):
            probs.append("an opaque op must be alone")
            return probs
        domains = {self.domain[i] for i in ms}
        if len(domains) > 1:
            probs.append(f"ops iterate over different shapes {sorted(domains, key=str)}")
        axes = {self.axes[i] for i in ms if self.axes[i] is not None}
        if len(axes) > 1:
            probs.append(f"reductions over different axes {sorted(axes)}")
        for i in ms:
            if self.kind[i] is OpKind.REDUCTION and any((mask >> s) & 1 for s in self.succs[i]):
                probs.append(f"reduction {self.ops[i].name!r} is used inside its group (a reduction may only end a group)")
        d = a = 0
        for i in ms:
            d |= self.desc[i]
            a |= self.anc[i]
        between = d & a & ~mask
        if between:
            probs.append(
                f"not convex: {[self.ops[i].name for i in self.members(between)]} lie on paths between members {names}"
            )
        return probs

    def quotient_cycle(self, masks: Sequence[int]) -> Optional[List[int]]:
        """A cycle of group indices in the graph with each group collapsed, or None."""
        owner = {}
        for g, m in enumerate(masks):
            for i in self.members(m):
                owner[i] = g
        edges: List[set] = [set() for _ in masks]
        for i in range(self.n):
            for s in self.succs[i]:
                if owner[i] != owner[s]:
                    edges[owner[i]].add(owner[s])
        color = [0] * len(masks)
        stack: List[int] = []

        def visit(g: int) -> Optional[List[int]]:
            color[g] = 1
            stack.append(g)
            for h in sorted(edges[g]):
                if color[h] == 1:
                    return stack[stack.index(h):] + [h]
                if color[h] == 0:
                    found = visit(h)
                    if found:
                        return found
            color[g] = 2
            stack.pop()
            return None

        for g in range(len(masks)):
            if color[g] == 0:
                found = visit(g)
                if found:
                    return found
        return None

    def make_group(self, index: int, mask: int) -> FusionGroup:
        ms = self.members(mask)
        reads, writes = self.io(mask)
        opaque = any(self.kind[i] is OpKind.OPAQUE for i in ms)
        axes = next((self.axes[i] for i in ms if self.axes[i] is not None), None)
        return FusionGroup(
            index=index,
            ops=tuple(self.ops[i].name for i in ms),
            inputs=tuple(reads),
            outputs=tuple(writes),
            domain=None if opaque else self.domain[ms[0]],
            reduce_axes=axes,
            opaque=opaque,
            bytes_read=sum(self.value_bytes[v] for v in reads),
            bytes_written=sum(self.value_bytes[v] for v in writes),
            bytes_before=sum(self.singleton_cost[i] for i in ms),
        )


class FusionPlan:
    """A partition of a graph's ops into groups, one kernel each, in an executable order."""

    def __init__(self, graph: FusionGraph, groups: Sequence[Sequence[str]], max_group_size: int,
                 method: str = "given", optimal: bool = False, search_nodes: int = 0):
        graph.freeze()
        self.graph = graph
        self.max_group_size = int(max_group_size)
        self.method = method
        self.optimal = optimal
        self.search_nodes = search_nodes
        self._compiled: Dict[str, Any] = {}
        self._index = _Index(graph)
        idx = self._index
        masks = []
        for g in groups:
            m = 0
            for name in g:
                if name not in idx.pos:
                    raise InvalidParameterError(f"group {list(g)} names {name!r}, which is not an op of the graph")
                m |= 1 << idx.pos[name]
            masks.append(m)
        # Executable order: groups sorted by the quotient graph when it is acyclic.
        order = list(range(len(masks)))
        covered = [i for m in masks for i in idx.members(m)]
        if sorted(covered) == list(range(idx.n)) and idx.quotient_cycle(masks) is None:
            order = _quotient_topo(idx, masks)
        self._masks = [masks[g] for g in order]
        self.groups: Tuple[FusionGroup, ...] = tuple(idx.make_group(k, m) for k, m in enumerate(self._masks))

    @property
    def bytes_before(self) -> int:
        """Bytes moved op by op (every op its own kernel)."""
        return sum(self._index.singleton_cost)

    @property
    def bytes_after(self) -> int:
        return sum(g.bytes_after for g in self.groups)

    def group_of(self, op_name: str) -> FusionGroup:
        return next(g for g in self.groups if op_name in g.ops)

    def problems(self) -> List[str]:
        """Every rule the plan breaks (empty for a correct plan)."""
        idx, probs = self._index, []
        seen: Dict[int, int] = {}
        for g, m in zip(self.groups, self._masks):
            if not m:
                probs.append(f"group {g.index} is empty")
            for i in idx.members(m):
                if i in seen:
                    probs.append(f"op {idx.ops[i].name!r} is in groups {seen[i]} and {g.index}")
                seen.setdefault(i, g.index)
        missing = [idx.ops[i].name for i in range(idx.n) if i not in seen]
        if missing:
            probs.append(f"ops {missing} are in no group")
        for g, m in zip(self.groups, self._masks):
            probs += [f"group {g.index} {list(g.ops)}: {p}" for p in idx.group_problems(m, self.max_group_size)]
            reads, writes = idx.io(m)
            if list(g.inputs) != reads or list(g.outputs) != writes:
                probs.append(f"group {g.index}: reads {list(g.inputs)} / writes {list(g.outputs)}, expected {reads} / {writes}")
            if g.bytes_after != idx.cost(m):
                probs.append(f"group {g.index}: bytes_after {g.bytes_after}, expected {idx.cost(m)}")
        if not probs:
            cyc = idx.quotient_cycle(self._masks)
            if cyc is not None:
                probs.append(f"collapsing the groups makes a cycle: groups {cyc}")
            else:
                done = set(self.graph.inputs)
                for g in self.groups:  # the stored order must be executable
                    if not set(g.inputs) <= done:
                        probs.append(f"group {g.index} runs before its inputs {sorted(set(g.inputs) - done)} exist")
                    done |= set(idx.ops[i].name for i in idx.members(self._masks[g.index]))
        return probs

    def validate(self) -> "FusionPlan":
        """Check every rule of a correct plan; raise InvalidParameterError listing what is broken.

        The rules: groups partition the ops; collapsing each group leaves the graph acyclic;
        every op on a path between two members of a group is in the group; a group's ops all
        iterate over one shape, only elementwise/broadcast ops produce values used inside the
        group, reductions only end it (all over the same axes); an opaque op is alone; a value
        used outside its group or a graph output is a group output; no group exceeds the cap.
        """
        probs = self.problems()
        if probs:
            raise InvalidParameterError("invalid fusion plan: " + "; ".join(probs))
        return self

    def report(self) -> str:
        """A table of the groups with bytes moved before and after fusion."""
        rows = [f"{'group':>5}  {'ops':>3}  {'before':>12}  {'after':>12}  members"]
        for g in self.groups:
            rows.append(f"{g.index:>5}  {len(g):>3}  {g.bytes_before:>12}  {g.bytes_after:>12}  {', '.join(g.ops)}")
        rows.append(f"{'total':>5}  {self._index.n:>3}  {self.bytes_before:>12}  {self.bytes_after:>12}  "
                    f"({self.method}{', optimal' if self.optimal else ''})")
        return "\n".join(rows)

    def compile(self, backend: Union[str, Backend] = "cpu") -> CompiledPlan:
        """Compile one kernel per group on ``backend`` (a backend name or an opened Backend).

        The ``fusion`` analysis plugin generates each group's source; the backend compiles it with
        its ``fusion`` capability (``optirs_fusion_compile``).

        :raises UnsupportedOperationError: naming the backend when it cannot open here or lacks
            the ``fusion`` capability.
        """
        self.validate()
        return CompiledPlan(self, backend)

    def run(self, inputs: Mapping[str, Any], backend: Union[str, Backend] = "cpu",
            out: Optional[Mapping[str, np.ndarray]] = None) -> Dict[str, np.ndarray]:
        """Execute the graph with one generated kernel per group; returns the graph outputs.

        The plan is compiled for ``backend`` on first use and the compiled plan kept; ``out``
        optionally gives preallocated arrays for graph outputs (see ``CompiledPlan.run``).
        """
        compiled = self._compiled.get(backend)
        if compiled is None:
            compiled = self.compile(backend)
            self._compiled[backend] = compiled
        return compiled.run(inputs, out)

    def __repr__(self) -> str:
        return (f"<FusionPlan {len(self.groups)} groups for {self._index.n} ops, "
                f"{self.bytes_before} -> {self.bytes_after} bytes ({self.method})>")


def _quotient_topo(idx: _Index, masks: List[int]) -> List[int]:
    owner = {i: g for g, m in enumerate(masks) for i in idx.members(m)}
    indeg = [0] * len(masks)
    edges: List[set] = [set() for _ in masks]
    for i in range(idx.n):
        for s in idx.succs[i]:
            a, b = owner[i], owner[s]
            if a != b and b not in edges[a]:
                edges[a].add(b)
                indeg[b] += 1
    # Stable: among ready groups, the one holding the earliest op first.
    first = [idx.members(m)[0] for m in masks]
    ready = sorted((g for g in range(len(masks)) if indeg[g] == 0), key=lambda g: first[g])
    order = []
    while ready:
        g = ready.pop(0)
        order.append(g)
        for h in edges[g]:
            indeg[h] -= 1
            if indeg[h] == 0:
                ready.append(h)
        ready.sort(key=lambda g: first[g])
    return order


# ================================================================ planning


class FusionPlanner:
    """Partitions a graph into fused groups that move the fewest bytes.

    :param max_group_size: the most ops one group (kernel) may hold.
    :param exact_limit: graphs of at most this many ops are searched exactly (branch and bound).
    :param search_budget: the most search nodes the exact search may visit; when exhausted the
        best plan found is returned with ``optimal=False``.
    """

    def __init__(self, max_group_size: int = 32, exact_limit: int = 12, search_budget: int = 200_000):
        for name, v, lo in (("max_group_size", max_group_size, 1), ("exact_limit", exact_limit, 0), ("search_budget", search_budget, 1)):
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < lo:
                raise InvalidParameterError(f"{name}={v!r}, expected an integer >= {lo}")
        self.max_group_size = int(max_group_size)
        self.exact_limit = int(exact_limit)
        self.search_budget = int(search_budget)

    def plan(self, graph: FusionGraph, method: str = "auto") -> FusionPlan:
        """Plan ``graph``.

        :param method: ``auto`` (exact up to ``exact_limit`` ops, greedy beyond), ``exact``,
            ``greedy``, or ``unfused`` (every op alone: the op-by-op baseline).
        """
        if not isinstance(graph, FusionGraph):
            raise InvalidParameterError(f"graph={graph!r}, expected a FusionGraph")
        methods = ("auto", "exact", "greedy", "unfused")
        if method not in methods:
            raise InvalidParameterError(f"method={method!r}, expected one of {methods}")
        graph.freeze()
        idx = _Index(graph)
        names = lambda masks: [[idx.ops[i].name for i in idx.members(m)] for m in masks]  # noqa: E731
        if method == "unfused" or idx.n == 0:
            return FusionPlan(graph, names([1 << i for i in range(idx.n)]), self.max_group_size, "unfused", idx.n <= 1)
        greedy = _greedy(idx, self.max_group_size)
        if method == "greedy" or (method == "auto" and idx.n > self.exact_limit):
            return FusionPlan(graph, names(greedy), self.max_group_size, "greedy", False)
        best, nodes, complete = _exact(idx, self.max_group_size, greedy, self.search_budget)
        return FusionPlan(graph, names(best), self.max_group_size, "exact" if complete else "exact (budget exhausted)", complete, nodes)


def _greedy(idx: _Index, cap: int) -> List[int]:
    """Merge pairs of groups, largest byte saving first, while the plan stays correct."""
    groups = [1 << i for i in range(idx.n)]
    # value name -> op indices reading it (sibling fusion: groups sharing an input)
    readers: Dict[str, List[int]] = {}
    for i, vs in enumerate(idx.operands):
        for v in vs:
            readers.setdefault(v, []).append(i)
    cost = {m: idx.cost(m) for m in groups}
    while True:
        owner = {i: g for g, m in enumerate(groups) for i in idx.members(m)}
        pairs = set()
        for i in range(idx.n):
            for s in idx.succs[i]:
                pairs.add(tuple(sorted((owner[i], owner[s]))))
        for rs in readers.values():
            gs = sorted({owner[i] for i in rs})
            for a in range(len(gs)):
                for b in range(a + 1, len(gs)):
                    pairs.add((gs[a], gs[b]))
        best = None
        for a, b in sorted(pairs):
            if a == b:
                continue
            m = groups[a] | groups[b]
            if m not in cost:
                cost[m] = idx.cost(m)
            saving = cost[groups[a]] + cost[groups[b]] - cost[m]
            if saving <= 0 or (best is not None and saving <= best[0]):
                continue
            if idx.group_problems(m, cap):
                continue
            trial = [g for k, g in enumerate(groups) if k not in (a, b)] + [m]
            if idx.quotient_cycle(trial) is not None:
                continue
            best = (saving, a, b)
        if best is None:
            return groups
        _, a, b = best
        groups = [g for k, g in enumerate(groups) if k not in (a, b)] + [groups[a] | groups[b]]


def _exact(idx: _Index, cap: int, upper: List[int], budget: int) -> Tuple[List[int], int, bool]:
    """Branch and bound over all partitions: ops in topological order, each joins an open group
    or starts a new one. Convexity and acyclicity are checked as each op is placed (every op on
    a path into it is placed already, so a violation found then is final), and a branch is cut
    when a lower bound on its cost reaches the best plan found (the greedy plan to start).
    """
    n = idx.n
    best_masks = list(upper)
    best_cost = sum(idx.cost(m) for m in upper)
    assign = [-1] * n
    masks: List[int] = []
    nodes = 0
    exhausted = False
    inputs = set(idx.graph.inputs)

    def can_join(g: int, i: int) -> bool:
        m = masks[g]
        ms = idx.members(m)
        if len(ms) >= cap or idx.kind[i] is OpKind.OPAQUE or idx.kind[ms[0]] is OpKind.OPAQUE:
            return False
        if idx.domain[i] != idx.domain[ms[0]]:
            return False
        if idx.axes[i] is not None:
            other = next((idx.axes[j] for j in ms if idx.axes[j] is not None), None)
            if other is not None and other != idx.axes[i]:
                return False
        if any(assign[p] == g and idx.kind[p] is OpKind.REDUCTION for p in idx.preds[i]):
            return False
        new = m | (1 << i)
        d = a = 0
        for j in ms + [i]:
            d |= idx.desc[j]
            a |= idx.anc[j]
        if d & a & ~new:
            return False
        # Acyclic quotient: adding i to g adds edges pred-group -> g; g must not reach them.
        targets = {assign[p] for p in idx.preds[i]} - {g}
        if targets and _reaches(g, targets):
            return False
        return True

    def _reaches(src: int, targets: set) -> bool:
        seen, todo = {src}, [src]
        while todo:
            g = todo.pop()
            for j in idx.members(masks[g]):
                for s in idx.succs[j]:
                    h = assign[s]
                    if h < 0 or h in seen:
                        continue
                    if h in targets:
                        return True
                    seen.add(h)
                    todo.append(h)
        return False

    def lower_bound(k: int) -> int:
        """Bytes every completion of the first k placements must move."""
        lb = 0
        read_by: Dict[str, set] = {}
        for c in range(k):
            for v in idx.operands[c]:
                p = idx.pos.get(v)
                if p is None or assign[p] != assign[c]:
                    read_by.setdefault(v, set()).add(assign[c])
        for v, gs in read_by.items():
            lb += idx.value_bytes[v] * len(gs)
        for p in range(k):
            name = idx.ops[p].name
            if name in idx.outputs or any(s < k and assign[s] != assign[p] for s in idx.succs[p]):
                lb += idx.out_bytes[p]
        for u in range(k, n):
            if idx.ops[u].name in idx.outputs:
                lb += idx.out_bytes[u]
            for v in idx.operands[u]:
                if v in inputs and v not in read_by:
                    read_by[v] = set()
                    lb += idx.value_bytes[v]
        return lb

    def search(i: int) -> None:
        nonlocal nodes, best_cost, best_masks, exhausted
        nodes += 1
        if nodes > budget:
            exhausted = True
            return
        if i == n:
            c = sum(idx.cost(m) for m in masks)
            if c < best_cost:
                best_cost, best_masks = c, list(masks)
            return
        if lower_bound(i) >= best_cost:
            return
        for g in range(len(masks)):
            if exhausted:
                return
            if can_join(g, i):
                masks[g] |= 1 << i
                assign[i] = g
                search(i + 1)
                masks[g] &= ~(1 << i)
                assign[i] = -1
        if exhausted:
            return
        masks.append(1 << i)
        assign[i] = len(masks) - 1
        search(i + 1)
        masks.pop()
        assign[i] = -1

    search(0)
    return best_masks, nodes, not exhausted

"""The kernel-fusion planner: graphs, plans, the rules a plan must keep, and generated kernels.

Everything a plan is checked against here is written in this file from the definitions in
docs/fusion.md (rules, cost model, numpy meaning of each op), not taken from the planner.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import optirs
from optirs.analysis.fusion import FusionGraph, FusionOp, FusionPlan, FusionPlanner, OpKind, codegen
from optirs.core.errors import InvalidParameterError, ShapeMismatchError, UnsupportedOperationError

F32 = np.float32

# ---------------------------------------------------------------- independent numpy meaning

NUMPY = {
    "neg": np.negative, "abs": np.abs, "square": np.square, "reciprocal": np.reciprocal,
    "sqrt": np.sqrt, "relu": lambda x: np.maximum(x, x.dtype.type(0)),
    "exp": np.exp, "log": np.log, "tanh": np.tanh, "sin": np.sin, "cos": np.cos,
    "sigmoid": lambda x: x.dtype.type(1) / (x.dtype.type(1) + np.exp(-x)),
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
    "maximum": np.maximum, "minimum": np.minimum, "pow": np.power,
    "greater": np.greater, "less": np.less, "equal": np.equal,
    "where": np.where, "muladd": lambda a, b, c: a * b + c,
    "clip": lambda x, lo, hi: np.minimum(np.maximum(x, lo), hi),
}
EXACT_UNARY = ["neg", "abs", "square", "reciprocal", "sqrt", "relu"]
EXACT_BINARY = ["add", "sub", "mul", "div", "maximum", "minimum"]
EXACT_TERNARY = ["muladd", "clip"]
COMPARE = ["greater", "less", "equal"]


def numpy_eval(graph: FusionGraph, inputs):
    """The unfused graph, op by op, in numpy; returns every value."""
    env = dict(inputs)
    for op in graph.ops:
        args = [env[v] if isinstance(v, str) else v for v in op.inputs]
        if op.op == "opaque":
            env[op.name] = op.fn(*args)
        elif op.op == "broadcast_to":
            env[op.name] = np.broadcast_to(args[0], op.shape).copy()
        elif op.op in ("sum", "max"):
            env[op.name] = np.asarray((np.sum if op.op == "sum" else np.max)(args[0], axis=op.axis))
        else:
            arrays = [np.asarray(a) for a in args if isinstance(a, (np.ndarray, np.generic))]
            floats = [a.dtype for a in arrays if a.dtype.kind == "f"]
            cdt = np.result_type(*floats)
            args = [np.asarray(a) if isinstance(a, (np.ndarray, np.generic)) else cdt.type(a) for a in args]
            env[op.name] = np.asarray(NUMPY[op.op](*args))
    return env


# ---------------------------------------------------------------- independent rule checks


def _reach(graph):
    succ = {op.name: set() for op in graph.ops}
    for op in graph.ops:
        for v in op.operand_names():
            if v in succ:
                succ[v].add(op.name)
    reach = {}
    for op in reversed(graph.ops):
        r = set()
        for s in succ[op.name]:
            r |= {s} | reach[s]
        reach[op.name] = r
    return succ, reach


def group_cost(graph, members, outputs):
    members = set(members)
    reads, writes = set(), set()
    for name in members:
        op = graph[name]
        for v in op.operand_names():
            if v not in members:
                reads.add(v)
    consumers = {}
    for op in graph.ops:
        for v in op.operand_names():
            consumers.setdefault(v, set()).add(op.name)
    for name in members:
        if name in outputs or consumers.get(name, set()) - members:
            writes.add(name)
    size = lambda v: math.prod(graph.shape(v)) * graph.dtype(v).itemsize  # noqa: E731
    return sum(map(size, reads)) + sum(map(size, writes)), reads, writes


def check_partition(graph, groups, cap):
    """Every rule of docs/fusion.md; returns the broken ones."""
    bad = []
    names = [op.name for op in graph.ops]
    flat = [n for g in groups for n in g]
    if sorted(flat) != sorted(names) or len(flat) != len(set(flat)):
        return ["not a partition"]
    succ, reach = _reach(graph)
    owner = {n: k for k, g in enumerate(groups) for n in g}
    for k, g in enumerate(groups):
        g = set(g)
        if len(g) > cap:
            bad.append(f"group {k} over cap")
        kinds = {graph[n].kind for n in g}
        if OpKind.OPAQUE in kinds and len(g) > 1:
            bad.append(f"group {k} opaque not alone")
        doms = set()
        for n in g:
            op = graph[n]
            doms.add(graph.shape(op.inputs[0]) if op.kind is OpKind.REDUCTION else op.shape)
            if op.kind is OpKind.REDUCTION and succ[n] & g:
                bad.append(f"group {k}: reduction {n} used inside")
        if len(doms) > 1 and OpKind.OPAQUE not in kinds:
            bad.append(f"group {k}: several domains")
        red_axes = {(graph[n].axis if graph[n].axis is not None or len(graph.shape(graph[n].inputs[0])) != 1 else 0)
                    for n in g if graph[n].kind is OpKind.REDUCTION}
        if len(red_axes) > 1:
            bad.append(f"group {k}: reductions over different axes")
        for a in g:  # convexity: anything reachable from a member that reaches a member is a member
            for mid in reach[a] - g:
                if reach[mid] & g:
                    bad.append(f"group {k}: {mid} between members")
    qsucc = {k: set() for k in range(len(groups))}
    for n in names:
        for s in succ[n]:
            if owner[n] != owner[s]:
                qsucc[owner[n]].add(owner[s])
    state = {}

    def cyc(k):
        state[k] = 1
        for h in qsucc[k]:
            if state.get(h) == 1 or (h not in state and cyc(h)):
                return True
        state[k] = 2
        return False

    if any(k not in state and cyc(k) for k in qsucc):
        bad.append("quotient graph has a cycle")
    return bad


def check_plan(graph, plan, cap):
    groups = [list(g.ops) for g in plan.groups]
    assert check_partition(graph, groups, cap) == []
    total = 0
    done = set(graph.inputs)
    for g in plan.groups:
        cost, reads, writes = group_cost(graph, g.ops, set(graph.outputs))
        assert set(g.inputs) == reads and set(g.outputs) == writes, g
        assert g.bytes_after == cost
        assert set(g.inputs) <= done, "groups are not in an executable order"
        done |= set(g.ops)
        total += cost
    assert plan.bytes_after == total
    unfused = sum(group_cost(graph, [op.name], set(graph.outputs))[0] for op in graph.ops)
    assert plan.bytes_before == unfused


def set_partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        yield [[first]] + part
        for k in range(len(part)):
            yield part[:k] + [[first] + part[k]] + part[k + 1:]


def brute_force_min(graph, cap):
    best = None
    outs = set(graph.outputs)
    for part in set_partitions([op.name for op in graph.ops]):
        if check_partition(graph, part, cap):
            continue
        c = sum(group_cost(graph, g, outs)[0] for g in part)
        best = c if best is None else min(best, c)
    return best


# ---------------------------------------------------------------- random graphs


@st.composite
def graphs(draw, max_ops=10, unary=EXACT_UNARY, binary=EXACT_BINARY, ternary=EXACT_TERNARY,
           reductions=("max",), allow_opaque=True, compare=True):
    m, k = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    shapes = [(m, k), (m, k), (k,), (), (m, 1)]
    g = FusionGraph()
    values = []
    for j in range(draw(st.integers(1, 3))):
        values.append(g.input(f"x{j}", draw(st.sampled_from(shapes)), F32))
    bools = []
    for _ in range(draw(st.integers(1, max_ops))):
        kind = draw(st.sampled_from(["u", "b", "b", "t", "r", "o", "c", "w", "bc"]))
        pick = lambda: draw(st.sampled_from(values))  # noqa: E731
        operand = lambda: pick() if draw(st.integers(0, 5)) else draw(st.sampled_from([0.5, 2.0, -1.5]))  # noqa: E731
        try:
            if kind == "u":
                values.append(g.op(draw(st.sampled_from(unary)), pick()))
            elif kind == "b":
                a, b = pick(), operand()
                if draw(st.booleans()):
                    a, b = b, a
                values.append(g.op(draw(st.sampled_from(binary)), a, b))
            elif kind == "t" and ternary:
                values.append(g.op(draw(st.sampled_from(ternary)), pick(), operand(), pick()))
            elif kind == "r" and reductions:
                v = pick()
                nd = len(g.shape(v))
                axis = draw(st.sampled_from([None] + list(range(nd))))
                values.append(g.reduce(draw(st.sampled_from(reductions)), v, axis=axis))
            elif kind == "o" and allow_opaque:
                v = pick()
                values.append(g.opaque(lambda a: a * np.float32(0.5), v, shape=g.shape(v), dtype=F32))
            elif kind == "c" and compare:
                bools.append(g.op(draw(st.sampled_from(COMPARE)), pick(), operand()))
            elif kind == "w" and bools:
                values.append(g.op("where", draw(st.sampled_from(bools)), pick(), operand()))
            elif kind == "bc":
                values.append(g.broadcast(pick(), (m, k)))
        except ShapeMismatchError:
            pass  # shapes that do not broadcast together: skip this op
    assume(len(g) > 0)
    return g


def random_inputs(graph, seed, low=-3.0, high=3.0):
    rng = np.random.default_rng(seed)
    return {n: rng.uniform(low, high, size=shape).astype(dt) for n, (shape, dt) in graph.inputs.items()}


def assert_same(got, want, exact, rtol=1e-5):
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape, got.dtype, want.dtype)
    if exact:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-6, equal_nan=True)


# Execution tests compile a few kernels per example (about a second each with parallel=True).
RUNS = settings(max_examples=int(os.environ.get("OPTIRS_FUSION_RUNS", "12")), deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
PROPERTY = settings(max_examples=int(os.environ.get("OPTIRS_FUSION_EXAMPLES", "25")), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def _cuda_available():
    try:
        from numba import cuda
        return cuda.is_available()
    except Exception:
        return False


SIM = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def _opencl_available():
    try:
        optirs.get_backend("opencl")
        return True
    except Exception:
        return False


def _backends():
    out = [pytest.param("cpu", id="cpu")]
    for name, ok in (("opencl", _opencl_available), ("cuda", _cuda_available)):
        marks = [getattr(pytest.mark, name), pytest.mark.skipif(not ok(), reason=f"{name} is not available here")]
        out.append(pytest.param(name, id=name, marks=marks))
    return out


# ================================================================ graph building and errors


def test_graph_infers_shapes_and_dtypes():
    g = FusionGraph()
    x = g.input("x", (4, 3), F32)
    b = g.input("b", (3,), F32)
    s = g.input("s", (), np.float64)
    y = g.op("add", x, b)
    z = g.op("mul", y, s)  # float32 * float64 promotes, as numpy does
    c = g.op("greater", y, 0.0)
    r = g.reduce("sum", y, axis=0)
    assert g.shape(y) == (4, 3) and g.dtype(y) == F32
    assert g.dtype(z) == np.float64
    assert g.dtype(c) == np.bool_
    assert g.shape(r) == (3,)
    assert g[y].kind is OpKind.ELEMENTWISE and g[r].kind is OpKind.REDUCTION
    assert set(g.outputs) == {z, c, r}


def test_graph_from_unordered_ops():
    ops = [FusionOp("c", "add", ("a", "b")), FusionOp("b", "exp", ("a",)), FusionOp("a", "neg", ("x",))]
    g = FusionGraph({"x": ((5,), F32)}, ops)
    assert [op.name for op in g.ops] == ["a", "b", "c"]


def test_cycle_is_reported_with_its_path():
    ops = [FusionOp("a", "neg", ("c",)), FusionOp("b", "exp", ("a",)), FusionOp("c", "add", ("b", "x"))]
    with pytest.raises(InvalidParameterError, match=r"cycle: .*a.*b.*c"):
        FusionGraph({"x": ((5,), F32)}, ops)


def test_unknown_input_is_named():
    with pytest.raises(InvalidParameterError, match="'nope'"):
        FusionGraph({"x": ((5,), F32)}, [FusionOp("a", "add", ("x", "nope"))])
    g = FusionGraph()
    g.input("x", (5,))
    with pytest.raises(InvalidParameterError, match="'y'"):
        g.op("add", "x", "y")
    assert len(g) == 0  # the failed call left the graph as it was


@pytest.mark.parametrize("build, err, match", [
    (lambda g: g.op("add", "x", "w"), ShapeMismatchError, r"\(4, 3\).*\(2,\)"),
    (lambda g: g.broadcast("x", (3, 4)), ShapeMismatchError, "cannot broadcast"),
    (lambda g: g.reduce("sum", "x", axis=2), InvalidParameterError, "axis=2"),
    (lambda g: g.reduce("max", "e", axis=0), ShapeMismatchError, "empty"),
    (lambda g: g.op("frobnicate", "x"), InvalidParameterError, "frobnicate"),
    (lambda g: g.op("add", "x"), InvalidParameterError, "1 operands, expected 2"),
    (lambda g: g.op("where", "x", "x", "x"), ShapeMismatchError, "bool"),
    (lambda g: g.op("add", 1.0, 2.0), InvalidParameterError, "constant"),
    (lambda g: g.add(FusionOp("y", "add", ("x", "x"), shape=(3, 4))), ShapeMismatchError, "declared shape"),
    (lambda g: g.opaque(len, "x", shape=(4, 3), dtype="int8"), ShapeMismatchError, "int8"),
    (lambda g: g.op("neg", "x", name="x"), InvalidParameterError, "already"),
])
def test_bad_graphs_raise(build, err, match):
    g = FusionGraph()
    g.input("x", (4, 3))
    g.input("w", (2,))
    g.input("e", (0, 3))
    before = len(g)
    with pytest.raises(err, match=match):
        build(g)
    assert len(g) == before


def test_planned_graph_is_frozen():
    g = FusionGraph()
    g.op("neg", g.input("x", (3,)))
    FusionPlanner().plan(g)
    with pytest.raises(InvalidParameterError, match="frozen"):
        g.op("exp", "x")


# ================================================================ hand-made plans


def chain_graph(n_ops, size=1000):
    g = FusionGraph()
    v = g.input("x", (size,))
    for k in range(n_ops):
        v = g.op(["exp", "neg", "sqrt", "abs"][k % 4] if k % 2 else "mul", v, *([] if k % 2 else [1.5]))
    return g


def test_chain_fuses_into_one_kernel():
    g = chain_graph(8)
    plan = FusionPlanner().plan(g)
    check_plan(g, plan, 32)
    assert len(plan.groups) == 1
    assert plan.bytes_after == 2 * 1000 * 4  # read x once, write the result once
    assert plan.bytes_before == 8 * 2 * 1000 * 4
    assert plan.optimal and plan.method == "exact"


def test_size_cap_splits_chain():
    g = chain_graph(10)
    plan = FusionPlanner(max_group_size=4).plan(g)
    check_plan(g, plan, 4)
    assert sorted(len(gr) for gr in plan.groups) == [2, 4, 4]
    assert plan.bytes_after == 3 * 2 * 4000  # 3 kernels, each reads 4000 bytes and writes 4000


def test_opaque_splits_and_multi_output():
    g = FusionGraph()
    x = g.input("x", (100,))
    a = g.op("sqrt", x, name="a")
    g.op("neg", a, name="b")
    g.opaque(lambda v: v[::-1].copy(), a, shape=(100,), dtype=F32, name="o")
    plan = FusionPlanner().plan(g)
    check_plan(g, plan, 32)
    assert [sorted(gr.ops) for gr in plan.groups] == [["a", "b"], ["o"]]
    assert set(plan.groups[0].outputs) == {"a", "b"}  # a is used by the opaque op: a group output
    assert plan.bytes_after == 5 * 400  # read x, write a and b; the opaque op reads a, writes o
    inp = {"x": np.arange(100, dtype=F32) / 50}
    got, want = plan.run(inp), numpy_eval(g, inp)
    for name in ("b", "o"):
        np.testing.assert_array_equal(got[name], want[name])


def test_consumer_after_opaque_joins_the_cheaper_side():
    # c = neg(sqrt(x)) + opaque(sqrt(x)): fusing b with c (reading a and o) moves less than
    # fusing b with a (which must then also write b for c).
    g = FusionGraph()
    x = g.input("x", (100,))
    a = g.op("sqrt", x, name="a")
    b = g.op("neg", a, name="b")
    o = g.opaque(lambda v: v[::-1].copy(), a, shape=(100,), dtype=F32, name="o")
    c = g.op("add", b, o, name="c")
    plan = FusionPlanner().plan(g)
    check_plan(g, plan, 32)
    assert [sorted(gr.ops) for gr in plan.groups] == [["a"], ["o"], ["b", "c"]]
    assert plan.bytes_after == 7 * 400
    inp = {"x": np.arange(100, dtype=F32) / 50}
    np.testing.assert_array_equal(plan.run(inp)[c], numpy_eval(g, inp)[c])


def test_convexity_blocks_fusion_around_opaque():
    g = FusionGraph()
    x = g.input("x", (64,))
    a = g.op("exp", x, name="a")
    o = g.opaque(np.negative, a, shape=(64,), dtype=F32, name="o")
    g.op("add", a, o, name="c")
    plan = FusionPlanner().plan(g)
    check_plan(g, plan, 32)
    assert len(plan.groups) == 3  # {a, c} would have o on a path between its members
    bad = FusionPlan(g, [["a", "c"], ["o"]], 32)
    with pytest.raises(InvalidParameterError, match="convex"):
        bad.validate()


def test_reduction_ends_group():
    g = FusionGraph()
    x = g.input("x", (8, 16))
    e = g.op("exp", x, name="e")
    s = g.reduce("sum", e, axis=1, name="s")
    m = g.op("mul", s, 2.0, name="m")
    plan = FusionPlanner().plan(g)
    check_plan(g, plan, 32)
    assert [sorted(gr.ops) for gr in plan.groups] == [["e", "s"], ["m"]]
    assert FusionPlan(g, [["e", "s", "m"]], 32).problems()  # s used inside its group, other domain
    inp = random_inputs(g, 1)
    np.testing.assert_allclose(plan.run(inp)[m], numpy_eval(g, inp)[m], rtol=1e-6)


def test_sibling_fusion_shares_input_read():
    g = FusionGraph()
    x = g.input("x", (256,))
    g.op("exp", x, name="a")
    g.op("neg", x, name="b")
    plan = FusionPlanner().plan(g)
    check_plan(g, plan, 32)
    assert len(plan.groups) == 1 and plan.bytes_after == 3 * 1024


def test_quotient_cycle_is_rejected():
    # a -> b and c -> d: {a, d} and {b, c} are each convex, but collapsed they form a cycle.
    g = FusionGraph()
    x = g.input("x", (8,))
    g.op("exp", x, name="a")
    g.op("neg", "a", name="b")
    g.op("abs", x, name="c")
    g.op("add", "c", "c", name="d")
    plan = FusionPlan(g, [["a", "d"], ["b", "c"]], 32)
    assert check_partition(g, [["a", "d"], ["b", "c"]], 32) == ["quotient graph has a cycle"]
    with pytest.raises(InvalidParameterError, match="cycle"):
        plan.validate()


@pytest.mark.parametrize("groups, match", [
    ([["a"]], "in no group"),
    ([["a", "b"], ["b", "o"]], "in groups"),
    ([["a", "o"], ["b"]], "opaque"),
    ([["a", "b", "o"]], "opaque"),
])
def test_validate_names_each_broken_rule(groups, match):
    g = FusionGraph()
    x = g.input("x", (8,))
    g.op("exp", x, name="a")
    g.op("neg", "a", name="b")
    g.opaque(np.negative, "b", shape=(8,), dtype=F32, name="o")
    with pytest.raises(InvalidParameterError, match=match):
        FusionPlan(g, groups, 32).validate()


def test_size_cap_is_checked():
    g = chain_graph(3)
    names = [[op.name for op in g.ops]]
    assert FusionPlan(g, names, 3).problems() == []
    with pytest.raises(InvalidParameterError, match="cap 2"):
        FusionPlan(g, names, 2).validate()


def test_different_domains_not_fused():
    g = FusionGraph()
    x = g.input("x", (4, 5))
    v = g.input("v", (5,))
    a = g.op("exp", v, name="a")  # (5,)
    g.op("mul", x, a, name="b")  # (4, 5): a would be recomputed per row; kept apart
    plan = FusionPlanner().plan(g)
    check_plan(g, plan, 32)
    assert len(plan.groups) == 2
    assert FusionPlan(g, [["a", "b"]], 32).problems()


def test_report_lists_bytes_per_group():
    plan = FusionPlanner().plan(chain_graph(4))
    text = plan.report()
    assert str(plan.bytes_before) in text and str(plan.bytes_after) in text


def test_planner_rejects_bad_settings():
    with pytest.raises(InvalidParameterError, match="max_group_size=0"):
        FusionPlanner(max_group_size=0)
    with pytest.raises(InvalidParameterError, match="method='fast'"):
        FusionPlanner().plan(chain_graph(2), method="fast")


# ================================================================ optimality


@PROPERTY
@given(graphs(max_ops=7), st.integers(2, 4))
def test_exact_search_is_optimal(graph, cap):
    plan = FusionPlanner(max_group_size=cap).plan(graph, method="exact")
    assert plan.optimal
    check_plan(graph, plan, cap)
    assert plan.bytes_after == brute_force_min(graph, cap)


@PROPERTY
@given(graphs(max_ops=12), st.integers(2, 12))
def test_exact_no_worse_than_greedy(graph, cap):
    planner = FusionPlanner(max_group_size=cap)
    exact = planner.plan(graph, method="exact")
    greedy = planner.plan(graph, method="greedy")
    check_plan(graph, exact, cap)
    check_plan(graph, greedy, cap)
    exact.validate()
    greedy.validate()
    assert exact.bytes_after <= greedy.bytes_after <= greedy.bytes_before


def test_greedy_on_large_graph_is_valid():
    rng = np.random.default_rng(7)
    g = FusionGraph()
    vals = [g.input(f"x{k}", (64,)) for k in range(4)]
    for k in range(120):
        if k % 17 == 16:
            vals.append(g.opaque(np.negative, vals[-1], shape=(64,), dtype=F32))
        else:
            a, b = rng.choice(len(vals), 2)
            vals.append(g.op(["add", "mul", "maximum"][k % 3], vals[a], vals[b]))
    plan = FusionPlanner(max_group_size=16).plan(g)
    assert plan.method == "greedy" and not plan.optimal
    check_plan(g, plan, 16)
    assert plan.bytes_after < plan.bytes_before


# ================================================================ execution on the CPU


@RUNS
@given(graphs(max_ops=10), st.integers(0, 2**31 - 1))
def test_fused_cpu_equals_numpy_exact_ops(graph, seed):
    """IEEE-exact ops (and max): the fused kernels give numpy's results bit for bit."""
    plan = FusionPlanner(max_group_size=6).plan(graph)
    plan.validate()
    check_plan(graph, plan, 6)
    inputs = random_inputs(graph, seed)
    got = plan.run(inputs)
    want = numpy_eval(graph, inputs)
    assert set(got) == set(graph.outputs)
    for name in graph.outputs:
        assert_same(got[name], want[name], exact=True)


@RUNS
@given(graphs(max_ops=10, unary=["sqrt", "tanh", "sigmoid", "exp", "square"], binary=["add", "mul", "maximum", "div"],
              ternary=["muladd"], reductions=("sum", "max"), compare=False), st.integers(0, 2**31 - 1))
def test_fused_cpu_close_to_numpy_with_libm_and_sums(graph, seed):
    """libm functions and float64-accumulated sums: within float32 rounding of numpy.

    Inputs are positive and every op here maps positives to positives, so no cancellation can
    magnify a last-bit difference; the tolerance allows a few ulp per op of depth.
    """
    plan = FusionPlanner(max_group_size=8).plan(graph)
    plan.validate()
    inputs = random_inputs(graph, seed, 0.25, 1.5)
    got = plan.run(inputs)
    want = numpy_eval(graph, inputs)
    for name in graph.outputs:
        assert_same(got[name], want[name], exact=False, rtol=2e-5 * len(graph))


def test_all_ops_on_cpu():
    """Every vocabulary op against numpy, including NaN, infinities and signed zeros."""
    vals = np.array([-2.5, -1.0, -0.0, 0.0, 0.5, 1.0, 3.0, np.inf, -np.inf, np.nan], F32)
    a, b = np.meshgrid(vals, vals)
    a, b = a.ravel(), b.ravel()
    c = np.roll(a, 3)
    g = FusionGraph()
    for n in "abc":
        g.input(n, a.shape)
    cond = g.op("greater", "a", "c", name="cond")
    outs = []
    for name, arity in [(n, 1) for n in ["neg", "abs", "square", "reciprocal", "sqrt", "relu", "exp", "log", "tanh", "sin", "cos", "sigmoid"]] + \
                       [(n, 2) for n in ["add", "sub", "mul", "div", "maximum", "minimum", "pow", "greater", "less", "equal"]] + \
                       [(n, 3) for n in ["muladd", "clip"]]:
        outs.append(g.op(name, *["a", "b", "c"][:arity], name=f"o_{name}"))
    outs.append(g.op("where", cond, "a", "b", name="o_where"))
    g.mark_output(*outs)
    plan = FusionPlanner(max_group_size=64).plan(g)
    assert len(plan.groups) == 1
    got = plan.run({"a": a, "b": b, "c": c})
    want = numpy_eval(g, {"a": a, "b": b, "c": c})
    with np.errstate(all="ignore"):
        for o in outs:
            exact = g[o].op not in ("exp", "log", "tanh", "sin", "cos", "sigmoid", "pow")
            assert_same(got[o], want[o], exact=exact)
            if exact and got[o].dtype.kind == "f":  # signed zeros as numpy gives them (a NaN's sign means nothing)
                num = ~np.isnan(want[o])
                np.testing.assert_array_equal(np.signbit(got[o][num]), np.signbit(want[o][num]), err_msg=o)


@pytest.mark.parametrize("fb", _backends())
def test_broadcast_operands_and_reductions(fb):
    rng = np.random.default_rng(3)
    g = FusionGraph()
    x = g.input("x", (3, 4, 5))
    row = g.input("row", (4, 1))
    s = g.input("s", ())
    y = g.op("muladd", x, row, s, name="y")
    b = g.broadcast(g.input("v", (5,)), (3, 4, 5))
    z = g.op("sub", y, b, name="z")
    for ax in (None, 0, 1, 2):
        g.reduce("sum", z, axis=ax, name=f"sum{ax}")
        g.reduce("max", z, axis=ax, name=f"max{ax}")
    g.mark_output(z)
    inputs = {"x": rng.standard_normal((3, 4, 5)).astype(F32), "row": rng.standard_normal((4, 1)).astype(F32),
              "s": np.float32(0.25), "v": rng.standard_normal(5).astype(F32)}
    plan = FusionPlanner().plan(g)
    check_plan(g, plan, 32)
    got, want = plan.run(inputs, backend=fb), numpy_eval(g, inputs)
    for name in g.outputs:
        exact = not name.startswith("sum")
        assert_same(got[name], want[name], exact=exact, rtol=1e-5)
        if not exact:  # float64 accumulation: at least as close to the float64 truth as numpy
            truth = numpy_eval(g, {k: np.asarray(v, np.float64) for k, v in inputs.items()})[name]
            assert np.all(np.abs(got[name] - truth) <= np.abs(want[name] - truth) + np.spacing(np.abs(truth).astype(F32)))


def test_generated_kernel_is_cached_per_signature():
    plan = FusionPlanner().plan(chain_graph(6, size=50))
    c1 = plan.compile("cpu")
    c2 = FusionPlanner().plan(chain_graph(6, size=70)).compile("cpu")  # same structure, other size
    assert c1.kernel_count == 1
    assert c1.kernels[0].kernel is c2.kernels[0].kernel
    assert "prange" in c1.sources()[0]


def test_unfused_plan_runs_one_kernel_per_op():
    g = chain_graph(4, size=64)
    plan = FusionPlanner().plan(g, method="unfused")
    assert plan.compile("cpu").kernel_count == 4
    inp = random_inputs(g, 0, 0.1, 2.0)
    np.testing.assert_allclose(plan.run(inp)[g.outputs[0]], numpy_eval(g, inp)[g.outputs[0]], rtol=1e-6)


@pytest.mark.parametrize("fb", _backends())
def test_mixed_dtypes_and_empty_arrays(fb):
    g = FusionGraph()
    x = g.input("x", (0, 3), F32)
    d = g.input("d", (3,), np.float64)
    y = g.op("mul", x, d, name="y")  # float64, numpy's promotion
    g.reduce("sum", y, axis=0, name="s")  # sum over an empty axis: zeros
    g.op("sqrt", d, name="r")
    g.mark_output("y", "s", "r")
    inputs = {"x": np.zeros((0, 3), F32), "d": np.array([0.5, 2.0, 9.0])}
    plan = FusionPlanner().plan(g)
    check_plan(g, plan, 32)
    got, want = plan.run(inputs, backend=fb), numpy_eval(g, inputs)
    for name in ("y", "s", "r"):
        assert_same(got[name], want[name], exact=True)


def test_search_budget_exhausted_is_reported():
    g = FusionGraph()
    xs = [g.input(f"x{k}", (8,)) for k in range(3)]
    for k in range(10):
        g.op("add", xs[k % 3], xs[(k + 1) % 3])
    plan = FusionPlanner(max_group_size=3, search_budget=5).plan(g)
    assert not plan.optimal and "budget" in plan.method
    check_plan(g, plan, 3)
    full = FusionPlanner(max_group_size=3).plan(g)
    assert full.optimal and full.bytes_after <= plan.bytes_after
    assert full.bytes_after == brute_force_min(g, 3) if len(g) <= 8 else True


def test_docs_example_runs():
    """The example in docs/fusion.md runs as written."""
    path = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "fusion.md")
    text = open(path).read()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "docs/fusion.md", "exec"), {})


def test_run_into_preallocated_outputs():
    g = chain_graph(4, size=64)
    plan = FusionPlanner().plan(g)
    name = g.outputs[0]
    buf = np.full(64, np.nan, F32)
    inp = random_inputs(g, 2, 0.1, 2.0)
    got = plan.run(inp, out={name: buf})
    assert got[name] is buf
    np.testing.assert_allclose(buf, numpy_eval(g, inp)[name], rtol=1e-6)
    with pytest.raises(ShapeMismatchError, match="expected a numpy array of shape"):
        plan.run(inp, out={name: np.zeros(63, F32)})
    with pytest.raises(InvalidParameterError, match="not a graph output"):
        plan.run(inp, out={"x": np.zeros(64, F32)})


def test_run_checks_inputs():
    g = chain_graph(2, size=10)
    plan = FusionPlanner().plan(g)
    with pytest.raises(ShapeMismatchError, match=r"shape \(9,\).*expected shape \(10,\)"):
        plan.run({"x": np.zeros(9, F32)})
    with pytest.raises(ShapeMismatchError, match="float64"):
        plan.run({"x": np.zeros(10)})
    with pytest.raises(InvalidParameterError, match="missing"):
        plan.run({})


def test_opaque_returning_wrong_shape_is_caught():
    g = FusionGraph()
    g.opaque(lambda a: a[:2], g.input("x", (4,)), shape=(4,), dtype=F32, name="o")
    with pytest.raises(ShapeMismatchError, match="'o' returned shape"):
        FusionPlanner().plan(g).run({"x": np.zeros(4, F32)})


def test_unknown_backend_is_unsupported():
    plan = FusionPlanner().plan(chain_graph(2))
    with pytest.raises(UnsupportedOperationError, match="'vulkan'"):
        plan.compile("vulkan")


@pytest.mark.cuda
@pytest.mark.skipif(_cuda_available(), reason="a CUDA device (or the simulator) is present")
def test_cuda_without_device_is_unsupported():
    plan = FusionPlanner().plan(chain_graph(2))
    with pytest.raises(UnsupportedOperationError, match="'cuda'"):
        plan.compile("cuda")


def test_every_backend_runs_a_plan_or_says_it_lacks_fusion(feature_backend):
    """Built-ins run the plan through their fusion hooks; a backend without them says so, naming itself."""
    g = FusionGraph()
    x = g.input("x", (5, 7))
    v = g.input("v", (7,))
    y = g.op("muladd", x, v, 0.25, name="y")
    g.reduce("max", y, axis=1, name="m")
    g.mark_output(y)
    rng = np.random.default_rng(11)
    inputs = {"x": rng.standard_normal((5, 7)).astype(F32), "v": rng.standard_normal(7).astype(F32)}
    plan = FusionPlanner().plan(g)
    backend = optirs.get_backend(feature_backend)
    if not backend.supports("fusion"):
        with pytest.raises(UnsupportedOperationError, match=rf"'{feature_backend}'.*'fusion'"):
            plan.run(inputs, backend=feature_backend)
        with pytest.raises(UnsupportedOperationError, match=rf"'{feature_backend}'.*'fusion'"):
            plan.compile(backend)
        return
    got, want = plan.run(inputs, backend=backend), numpy_eval(g, inputs)
    for name in g.outputs:
        assert_same(got[name], want[name], exact=True)


def test_plugin_is_listed():
    plugins = {p.name: p for p in optirs.list_plugins()}
    assert plugins["fusion"].kind == "analysis"
    assert "fusion" in plugins["fusion"].summary


# ================================================================ cuda and opencl


@pytest.mark.cuda
@pytest.mark.skipif(SIM, reason="compile_ptx needs the real CUDA compiler, not the simulator")
def test_cuda_kernels_compile_to_ptx_for_sm90():
    pytest.importorskip("numba.cuda")
    g = FusionGraph()
    x = g.input("x", (16, 8))
    v = g.input("v", (8,))
    y = g.op("sigmoid", g.op("muladd", x, v, 0.5))
    g.reduce("sum", y, axis=1)
    g.reduce("max", g.op("maximum", x, 1.0))
    plan = FusionPlanner().plan(g)
    for group in plan.groups:
        try:
            from optirs.backends.cuda.fusion import compile_ptx

            ptx = compile_ptx(codegen.group_source(plan.graph, group), cc=(9, 0))
        except Exception as exc:  # noqa: BLE001 - no CUDA toolkit here
            pytest.skip(f"numba.cuda.compile_ptx unavailable: {exc}")
        assert ".target sm_90" in ptx and "kernel_" in ptx
        if "mul_f32(" in codegen.cuda_source(plan, group):
            # a * b + c stays two roundings, as numpy computes it: the product is an explicit
            # round-to-nearest multiply that NVVM may not contract into an fma.
            assert "mul.rn.f32" in ptx


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda_available(), reason="no CUDA device (NUMBA_ENABLE_CUDASIM=1 runs the simulator)")
@RUNS
@given(graphs(max_ops=6), st.integers(0, 2**31 - 1))
def test_fused_cuda_equals_numpy(graph, seed):
    plan = FusionPlanner(max_group_size=4).plan(graph)
    inputs = random_inputs(graph, seed)
    got, want = plan.run(inputs, backend="cuda"), numpy_eval(graph, inputs)
    for name in graph.outputs:
        assert_same(got[name], want[name], exact=True)


@pytest.mark.skipif(not _opencl_available(), reason="no OpenCL device (pyopencl with PoCL runs on the CPU)")
@RUNS
@given(graphs(max_ops=8), st.integers(0, 2**31 - 1))
def test_fused_opencl_equals_numpy(graph, seed):
    plan = FusionPlanner(max_group_size=6).plan(graph)
    inputs = random_inputs(graph, seed)
    got, want = plan.run(inputs, backend="opencl"), numpy_eval(graph, inputs)
    for name in graph.outputs:
        assert_same(got[name], want[name], exact=True)


@pytest.mark.skipif(not _opencl_available(), reason="no OpenCL device (pyopencl with PoCL runs on the CPU)")
def test_opencl_sums_and_libm():
    rng = np.random.default_rng(5)
    g = FusionGraph()
    x = g.input("x", (6, 50))
    y = g.op("tanh", g.op("exp", g.op("mul", x, 0.5)))
    g.reduce("sum", y, axis=0, name="s0")
    g.reduce("sum", y, name="s")
    g.mark_output(y)
    inputs = {"x": rng.standard_normal((6, 50)).astype(F32)}
    got, want = FusionPlanner().plan(g).run(inputs, backend="opencl"), numpy_eval(g, inputs)
    for name in g.outputs:
        assert_same(got[name], want[name], exact=False, rtol=1e-5)

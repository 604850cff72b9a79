"""Op facts live on the op's registry entry (``ir.registry.OpDef``): registering an op is one place.

- A toy op registered in this test only (``expand_copy``, which Rhino does not register) is sharded,
  lowered and checked against torch through its facts alone: with its ``size_args`` fact every strategy
  is exact, without it a split strategy fails; with its ``linear`` fact the rules, the rule check and the
  search's strategy space offer a partial passthrough, without it none.
- The cost model's and the lowering's facts (custom all-reduces, output placements) are read from the
  entry: a planted change of the entry changes what they answer.
- Every fact value has its consumer (a new ``SizeRule`` or ``Lowering`` without one fails here).
- No aten-name table or op-name test outside ``ir/`` (a source scan: string constants that name an
  aten op, docstrings excepted).
"""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from rhino.cost.step import custom_reduce_bytes, custom_reduces
from rhino.ir.graph import Graph, Node, Ref, Role
from rhino.ir.ops_shape import expand_rule
from rhino.ir.registry import (REGISTRY, InputLayout, Linear, Lowering, OpDef, OpKind, OutputRule, SizeArg, SizeRule,
                               lookup)
from rhino.ir.types import DType, TensorType
from rhino.lower import spmd, spmd_custom
from rhino.lower.rulecheck import MESHES, check_call, record_call, strategies
from rhino.search.options import SearchOptions
from rhino.search.space import Space
from rhino.sharding.mesh import Mesh
from rhino.sharding.placement import Partial
from rhino.sharding.plan import node_shardings
from rhino.sharding.rules import PASS

SRC = Path(__file__).resolve().parents[1] / "src" / "rhino"
TOY = "aten.expand_copy.default"


@pytest.fixture(autouse=True)
def float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _register_toy(monkeypatch, **facts) -> None:
    lookup(TOY)  # loads the tables
    assert TOY not in REGISTRY, "the toy op must be one Rhino does not register"
    monkeypatch.setitem(REGISTRY, TOY, OpDef(TOY, OpKind.DATA_MOVEMENT, expand_rule, **facts))


def _toy_args():
    return (torch.randn(4, 1, 8), [4, 6, 8])


def test_a_registered_toy_op_is_sharded_and_lowered_from_its_facts(monkeypatch):
    _register_toy(monkeypatch, size_args=(SizeArg(1, SizeRule.OUT_SHAPE),), linear=Linear.ALL)
    res = check_call(TOY, _toy_args())
    assert len(res) > 10 and all(r.ok for r in res), [r for r in res if not r.ok][:2]
    split = [r for r in res if any(e and not e.startswith(PASS) for e in r.strategy)]
    passthrough = [r for r in res if any(e and e.startswith(PASS) for e in r.strategy)]
    assert split and passthrough


def test_without_its_size_fact_the_lowering_is_wrong(monkeypatch):
    _register_toy(monkeypatch, linear=Linear.ALL)
    res = check_call(TOY, _toy_args(), meshes=MESHES[:1])
    bad = [r for r in res if not r.ok]
    assert bad and all(any(e and not e.startswith(PASS) for e in r.strategy) for r in bad)


def _toy_space(linear) -> tuple[list, list]:
    """(rule check strategies, search space candidates) of the toy call on 2 ranks."""
    call = record_call(TOY, _toy_args())
    mesh = MESHES[0]
    return strategies(call, mesh), Space(call.graph, mesh, SearchOptions()).candidates(0)


@pytest.mark.parametrize("linear", [Linear.ALL, None])
def test_the_linear_fact_gives_passthrough(monkeypatch, linear):
    _register_toy(monkeypatch, size_args=(SizeArg(1, SizeRule.OUT_SHAPE),), linear=linear)
    checked, cands = _toy_space(linear)
    for found in (checked, cands):
        has_pass = any(e is not None and e.startswith(PASS) for s in found for e in s)
        assert has_pass == (linear is not None), found


def test_cost_facts_are_read_from_the_entry(monkeypatch):
    op = "aten._log_softmax.default"
    assert custom_reduces(op) == 2 and custom_reduce_bytes(op, (4, 3, 8), 8) == 4 * 3 * 8
    monkeypatch.setitem(REGISTRY, op, dataclasses.replace(lookup(op), reduces=5, per_channel=True))
    assert custom_reduces(op) == 5 and custom_reduce_bytes(op, (4, 3, 8), 8) == 2 * 3 * 8
    assert custom_reduces(TOY) == 0


def _nll_graph(reduction: int) -> tuple[Graph, Node]:
    g = Graph()
    x = g.add_input("x", Role.BATCH, TensorType((4, 6), DType.float64))
    t = g.add_input("t", Role.BATCH, TensorType((4,), DType.int64))
    outs = [g.new_value(TensorType((), DType.float64)), g.new_value(TensorType((), DType.float64))]
    node = Node("nll", "aten.nll_loss_forward.default", [Ref(x), Ref(t), None, reduction, -100], {}, outs, True)
    g.nodes.append(node)
    return g, node


def _partial_outputs(reduction: int) -> list[bool]:
    g, node = _nll_graph(reduction)
    return [isinstance(o[0], Partial) for o in node_shardings(g, node, ("n",), Mesh(("x",), (2,))).outputs]


def test_output_placements_follow_the_outputs_fact(monkeypatch):
    """nll_loss over a split batch: a mean is replicated (its lowering all-reduces), a sum stays Partial;
    without the fact the mean is Partial too."""
    assert _partial_outputs(1) == [False, False] and _partial_outputs(2) == [True, True]
    op = "aten.nll_loss_forward.default"
    monkeypatch.setitem(REGISTRY, op, dataclasses.replace(lookup(op), outputs=None))
    assert _partial_outputs(1) == [True, True]
    monkeypatch.setitem(REGISTRY, op, dataclasses.replace(lookup(op), outputs=OutputRule.REPLICATED))
    assert _partial_outputs(2) == [False, False]


def test_every_fact_value_has_a_consumer():
    lookup(TOY)
    assert set(spmd._REWRITE) == set(SizeRule)
    batch_norm = {Lowering.BATCH_NORM, Lowering.BATCH_NORM_NO_STATS, Lowering.BATCH_NORM_BACKWARD}
    assert set(spmd_custom._LOWERINGS) | batch_norm == set(Lowering)
    for name, d in REGISTRY.items():
        assert not d.reduces or d.lowering is not None, f"{name}: all-reduces without a custom lowering"
        assert all(a.rule in SizeRule for a in d.size_args), name
        assert d.local_op is None or d.local_op in REGISTRY, f"{name}: local op {d.local_op} is not registered"


def _aten_literals(path: Path) -> list[tuple[int, str]]:
    """String constants naming an aten op (``"aten.x..."``), docstrings excepted."""
    tree = ast.parse(path.read_text())
    docs = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body \
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant):
            docs.add(id(n.body[0].value))
    return [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and "aten." in n.value and id(n) not in docs]


def test_no_op_name_tables_outside_ir():
    found = {f"{p.relative_to(SRC)}:{line}": s for p in sorted(SRC.rglob("*.py")) if "ir" not in p.relative_to(SRC).parts
             for line, s in _aten_literals(p)}
    assert not found, f"aten op names outside ir/ (put the fact on the op's registry entry): {found}"
    assert _aten_literals(SRC / "ir" / "ops_nn.py"), "the scan finds the names where they belong"


def _other_layout(t):
    """``t``'s values in another memory layout: dimensions stored in reverse order (1-D: every other element
    of a larger buffer), as a rank can hold a tensor after a redistribution."""
    if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.numel() < 2:
        return t
    if t.dim() == 1:
        return torch.empty(2 * t.shape[0], dtype=t.dtype)[::2].copy_(t)
    order = list(range(t.dim()))[::-1]
    return t.permute(order).contiguous().permute(order)


def _map(a, f):
    return type(a)(_map(x, f) for x in a) if isinstance(a, (list, tuple)) else f(a)


def _close(got, want) -> bool:
    if isinstance(want, torch.Tensor):
        if not (want.is_floating_point() or want.is_complex()):
            return torch.equal(got, want)
        scale = want.abs().max().item() if want.numel() else 0.0
        return got.shape == want.shape and bool(((got - want).abs() <= 1e-12 * max(1.0, scale)).all())
    if isinstance(want, (list, tuple)):
        return all(_close(g, w) for g, w in zip(got, want))
    return True


def test_every_op_gives_its_values_whatever_the_layout_of_its_inputs():
    """A rank may hold an input laid out otherwise than eager PyTorch does (the transpose of an all-gathered
    value). Every sampled non-view op, called as the lowering calls it (``resolve_op``), gives the same values
    for inputs stored in reverse dimension order: kernels that read their inputs as contiguous carry the
    ``input_layout`` fact (without it layer norm's backward was off by 2.0 here)."""
    import sys
    sys.path.insert(0, str(Path(__file__).parent))
    from rule_samples import NO_CPU_KERNEL, samples
    from rhino.ir.registry import Values, storage_offset_arg
    from rhino.lower.fx import resolve_op
    checked, wrong = 0, []
    for op, args, kwargs in samples():
        d = lookup(op)
        if op in NO_CPU_KERNEL or d.kind is OpKind.VIEW or d.values is not Values.COMPUTED \
                or storage_offset_arg(op) is not None:     # as_strided reads its input's storage by definition
            continue
        fn = resolve_op(op)
        want = fn(*_map(args, lambda t: t.contiguous() if isinstance(t, torch.Tensor) else t), **kwargs)
        got = fn(*_map(args, _other_layout), **kwargs)
        checked += 1
        if not _close(got, want):
            wrong.append(op)
    assert checked > 400 and not wrong, wrong


def test_an_opaque_op_runs_on_contiguous_inputs():
    """Opaque ops, and ops with the contiguous ``input_layout`` fact, are called on contiguous inputs: PyTorch's
    ``_weight_norm_interface_backward`` kernel reads a transposed gradient as if it were contiguous (a
    weight-normed Linear under a random plan was off by 0.08 while it was opaque; it now has a rule and the
    fact)."""
    from rhino.lower.fx import OnContiguous, resolve_op
    assert lookup("aten.special_erfcx.default") is None and \
        isinstance(resolve_op("aten.special_erfcx.default"), OnContiguous)      # opaque: wrapped
    op = "aten._weight_norm_interface_backward.default"
    assert lookup(op).input_layout is InputLayout.CONTIGUOUS
    g = torch.Generator().manual_seed(0)
    grad, v = torch.randn(16, 8, generator=g, dtype=torch.float64), torch.randn(16, 8, generator=g, dtype=torch.float64)
    w_g = torch.rand(16, 1, generator=g, dtype=torch.float64) + 0.5
    norms = v.norm(dim=1, keepdim=True)
    want = resolve_op(op)(grad, v, w_g, norms, 0)
    transposed = grad.t().contiguous().t()
    got = resolve_op(op)(transposed, v, w_g, norms, 0)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    raw = torch.ops.aten._weight_norm_interface_backward.default(transposed, v, w_g, norms, 0)
    assert not torch.allclose(raw[0], want[0]), "the kernel reads the layout right now: the copy is not needed"

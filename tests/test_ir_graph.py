"""The IR graph: JSON round trip, fingerprints, and the verifier's negative cases."""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rhino.ir.graph import FORMAT_VERSION, Graph, GraphInput, GraphOutput, Node, Ref, Role
from rhino.ir.types import Device, DType, Layout, MemoryFormat, TensorType
from rhino.ir.verify import VerifyError, is_inplace_op, verify

FAST = settings(max_examples=30, deadline=None)
F32 = DType.float32


def f32(*shape: int) -> TensorType:
    return TensorType(tuple(shape), F32)


def train_step() -> Graph:
    """A valid training step: loss = sum(x @ w); w' = w - lr * m'; m' = 0.9 m + grad.

    Its args exercise every kind of constant the JSON encoding handles."""
    g = Graph()
    w = g.add_input("w", Role.PARAM, f32(3, 4))
    m = g.add_input("opt.m", Role.OPT_STATE, f32(3, 4))
    step = g.add_input("opt.step", Role.OPT_STATE, TensorType((), DType.int64))
    x = g.add_input("x", Role.BATCH, f32(2, 3))
    c = g.new_value(f32(4))
    g.constants[c] = [1.0, float("inf"), float("-inf"), float("nan")]

    def node(op, args, out_types, kwargs=None, multi=False):
        outs = [g.new_value(t) if t is not None else None for t in out_types]
        g.nodes.append(Node(f"n{len(g.nodes)}", op, args, kwargs or {}, outs, multi))
        return outs

    y, = node("aten.mm.default", [Ref(x), Ref(w)], [f32(2, 4)])
    yc, = node("aten.add.Tensor", [Ref(y), Ref(c)], [f32(2, 4)])
    loss, = node("aten.sum.dim_IntList", [Ref(yc), [0, 1], False], [f32()], {"dtype": F32})
    gy, = node("aten.expand.default", [Ref(loss), [2, 4]], [f32(2, 4)])
    xt, = node("aten.t.default", [Ref(x)], [f32(3, 2)])
    gw, = node("aten.mm.default", [Ref(xt), Ref(gy)], [f32(3, 4)])
    m2, = node("aten.lerp.Scalar", [Ref(m), Ref(gw), 0.1], [f32(3, 4)])
    w2, = node("aten.add.Tensor", [Ref(w), Ref(m2)], [f32(3, 4)], {"alpha": -0.01})
    s2, = node("aten.add.Scalar", [Ref(step), 1], [TensorType((), DType.int64)])
    # an opaque op carrying every kind of constant argument
    node("rhino_test.opaque.default",
         [Ref(x), float("inf"), float("-inf"), float("nan"), -0.0, 1e300, None, True, "mean",
          (1, (2, 3)), [[1, 2], [3, [4, Ref(y)]]], DType.bfloat16, Device("cpu"), Layout("strided"),
          MemoryFormat("channels_last")],
         [f32(2, 3), None], {"dtype": DType.int8, "pin": False, "nested": {"k": (1.5, [Ref(x)])}}, multi=True)
    g.outputs += [GraphOutput("loss", Role.LOSS, loss), GraphOutput("w", Role.PARAM, w2),
                  GraphOutput("opt.m", Role.OPT_STATE, m2), GraphOutput("opt.step", Role.OPT_STATE, s2)]
    g.meta["workload"] = "tiny"
    return g


def test_train_step_is_valid():
    verify(train_step())


# -- JSON ----------------------------------------------------------------------------------
def test_json_round_trip():
    g = train_step()
    text = g.to_json()
    json.loads(text)  # strict JSON: no bare NaN/Infinity
    assert "NaN" not in text and "Infinity" not in text
    h = Graph.from_json(text)
    assert h.to_dict() == g.to_dict()
    assert h.to_json() == text
    assert h.types == g.types
    assert h.inputs == g.inputs and h.outputs == g.outputs
    assert h.meta == g.meta
    verify(h)


def test_json_round_trip_keeps_constant_kinds():
    h = Graph.from_json(train_step().to_json(indent=2))
    opaque = h.nodes[-1]
    args, kwargs = opaque.args, opaque.kwargs
    assert args[0] == Ref(3)
    assert args[1] == math.inf and args[2] == -math.inf and math.isnan(args[3])
    assert math.copysign(1.0, args[4]) == -1.0 and args[5] == 1e300
    assert args[6] is None and args[7] is True and args[8] == "mean"
    assert args[9] == (1, (2, 3)) and type(args[9]) is tuple and type(args[9][1]) is tuple
    assert args[10] == [[1, 2], [3, [4, Ref(h.nodes[0].outputs[0])]]] and type(args[10][1]) is list
    assert args[11] is DType.bfloat16
    assert args[12] == Device("cpu") and args[13] == Layout("strided")
    assert args[14] == MemoryFormat("channels_last")
    assert kwargs["dtype"] is DType.int8 and kwargs["pin"] is False
    assert kwargs["nested"] == {"k": (1.5, [Ref(3)])}
    assert opaque.outputs[1] is None and opaque.multi is True
    const = next(iter(h.constants.values()))
    assert const[:3] == [1.0, math.inf, -math.inf] and math.isnan(const[3])
    assert all(isinstance(k, int) for k in h.types) and all(isinstance(k, int) for k in h.constants)
    assert h.nodes[2].kwargs == {"dtype": F32} and h.nodes[2].kwargs["dtype"] is F32
    assert h.types[h.inputs_by_role(Role.OPT_STATE)[1].value].dtype is DType.int64


json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**62, 2**62), st.text(max_size=5),
                         st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(list(DType)),
                         st.builds(Device, st.sampled_from(["cpu", "cuda", "meta"])),
                         st.builds(Ref, st.integers(0, 3)))
json_args = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.lists(inner, max_size=3).map(tuple),
    st.dictionaries(st.text(min_size=1, max_size=3), inner, max_size=3)), max_leaves=12)


@FAST
@given(args=st.lists(json_args, max_size=4), kwargs=st.dictionaries(st.text(min_size=1, max_size=4), json_args,
                                                                   max_size=3))
def test_json_round_trip_random_args(args, kwargs):
    g = Graph()
    x = g.add_input("x", Role.BATCH, f32(2))
    g.nodes.append(Node("n", "rhino_test.opaque.default", [Ref(x)] + args, kwargs, [g.new_value(f32(2))]))
    h = Graph.from_json(g.to_json())
    assert h.to_dict() == g.to_dict()
    assert h.fingerprint() == g.fingerprint()
    assert _same(h.nodes[0].args, g.nodes[0].args) and _same(h.nodes[0].kwargs, g.nodes[0].kwargs)


def _same(a, b) -> bool:
    """Equality that also checks container types and treats NaN as equal to NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def test_json_errors():
    d = train_step().to_dict()
    with pytest.raises(ValueError, match="format"):
        Graph.from_dict({**d, "format": FORMAT_VERSION + 1})
    bad = json.loads(json.dumps(d))
    bad["nodes"][0]["args"][0] = {"bogus": 1}
    with pytest.raises(ValueError, match="tag"):
        Graph.from_dict(bad)
    g = Graph()
    x = g.add_input("x", Role.BATCH, f32(1))
    g.nodes.append(Node("n", "rhino_test.opaque.default", [Ref(x), object()], {}, [g.new_value(f32(1))]))
    with pytest.raises(TypeError, match="cannot encode"):
        g.to_json()


# -- fingerprint -----------------------------------------------------------------------------
def test_fingerprint_is_stable():
    g = train_step()
    fp = g.fingerprint()
    assert fp == g.fingerprint() == train_step().fingerprint()
    assert Graph.from_json(g.to_json()).fingerprint() == fp
    assert Graph.from_json(g.to_json(indent=4)).fingerprint() == fp
    assert len(fp) == 16 and int(fp, 16) >= 0


@pytest.mark.parametrize("change", ["shape", "dtype", "op", "arg", "constant", "role", "nan_to_inf"])
def test_fingerprint_changes_with_the_program(change):
    g = train_step()
    fp = g.fingerprint()
    if change == "shape":
        g.types[g.inputs[3].value] = f32(5, 3)
    elif change == "dtype":
        g.types[g.inputs[0].value] = TensorType((3, 4), DType.float64)
    elif change == "op":
        g.nodes[1].op = "aten.sub.Tensor"
    elif change == "arg":
        g.nodes[2].args[1] = [1, 0]
    elif change == "constant":
        next(iter(g.constants.values()))[0] = 2.0
    elif change == "role":
        g.inputs[0].role = Role.FROZEN
    else:
        g.nodes[-1].args[3] = float("inf")
    assert g.fingerprint() != fp


# -- the verifier: each broken invariant is a VerifyError --------------------------------------------
def _tiny() -> tuple[Graph, dict[str, int]]:
    """loss = sum(x * w); w' = w * 1 (shaped so the annotation fits)."""
    g = Graph()
    v = {"w": g.add_input("w", Role.PARAM, f32(3)), "x": g.add_input("x", Role.BATCH, f32(2, 3))}
    v["y"] = g.new_value(f32(2, 3))
    g.nodes.append(Node("mul", "aten.mul.Tensor", [Ref(v["x"]), Ref(v["w"])], {}, [v["y"]]))
    v["loss"] = g.new_value(f32())
    g.nodes.append(Node("sum", "aten.sum.default", [Ref(v["y"])], {}, [v["loss"]]))
    v["w2"] = g.new_value(f32(3))
    g.nodes.append(Node("upd", "aten.mul.Scalar", [Ref(v["w"]), 1.0], {}, [v["w2"]]))
    g.outputs += [GraphOutput("loss", Role.LOSS, v["loss"]), GraphOutput("w", Role.PARAM, v["w2"])]
    return g, v


def test_tiny_is_valid():
    g, _ = _tiny()
    verify(g)


def _broken(what: str) -> Graph:
    g, v = _tiny()
    if what == "use before definition":
        g.nodes[0], g.nodes[1] = g.nodes[1], g.nodes[0]
    elif what == "use of an unknown value":
        g.nodes[1].args[0] = Ref(99)
    elif what == "value redefined by a node":
        g.nodes[2].outputs = [v["y"]]
        g.outputs[1].value = v["y"]
    elif what == "node redefines an input":
        g.nodes[2].outputs = [v["w"]]
    elif what == "input defined twice":
        g.inputs.append(GraphInput("x2", Role.BATCH, v["x"]))
    elif what == "input name used twice":
        g.inputs.append(GraphInput("x", Role.BATCH, g.new_value(f32(1))))
    elif what == "value without a type":
        g.nodes[2].outputs = [42]
    elif what == "in-place op":
        g.nodes[2].op = "aten.mul_.Scalar"
    elif what == "in-place dunder op":
        g.nodes[0].op = "aten.__iand__.Tensor"
    elif what == "out overload":
        g.nodes[1].op = "aten.sum.IntList_out"
    elif what == "missing loss":
        del g.outputs[0]
    elif what == "two losses":
        g.outputs.append(GraphOutput("loss2", Role.LOSS, v["loss"]))
    elif what == "non-scalar loss":
        g.outputs[0].value = v["y"]
    elif what == "state output without matching input":
        g.outputs.append(GraphOutput("b", Role.BUFFER, v["w2"]))
    elif what == "state output renamed":
        g.outputs[1].name = "weight"
    elif what == "state output twice":
        g.outputs.append(GraphOutput("w", Role.PARAM, v["w2"]))
    elif what == "state input with no output":
        g.inputs.append(GraphInput("m", Role.OPT_STATE, g.new_value(f32(3))))
    elif what == "buffer with no output":
        g.inputs.append(GraphInput("running_mean", Role.BUFFER, g.new_value(f32(3))))
    elif what == "state shape change":
        g.outputs[1].value = v["y"]
    elif what == "state dtype change":
        g.types[v["w2"]] = TensorType((3,), DType.float16)
        g.nodes[2].op = "rhino_test.opaque.default"  # keep the shape check out of it
    elif what == "output of an undefined value":
        g.outputs[1].value = g.new_value(f32(3))
    elif what == "recorded shape contradicts the annotation":
        g.types[v["y"]] = f32(3, 2)
    elif what == "recorded output count contradicts the annotation":
        g.nodes[1].outputs = [v["loss"], None]
    elif what == "inputs contradict the annotation":
        g.nodes[0].op = "aten.mm.default"
    else:
        raise AssertionError(what)
    return g


BROKEN = ["use before definition", "use of an unknown value", "value redefined by a node", "node redefines an input",
          "input defined twice", "input name used twice", "value without a type", "in-place op",
          "in-place dunder op", "out overload", "missing loss", "two losses", "non-scalar loss",
          "state output without matching input", "state output renamed", "state output twice",
          "state input with no output", "buffer with no output", "state shape change", "state dtype change",
          "output of an undefined value", "recorded shape contradicts the annotation",
          "recorded output count contradicts the annotation", "inputs contradict the annotation"]


@pytest.mark.parametrize("what", BROKEN)
def test_verifier_rejects(what):
    with pytest.raises(VerifyError):
        verify(_broken(what))


def test_verifier_rejects_untyped_output_without_crashing():
    g, v = _tiny()
    g.nodes[2].outputs = [42]
    g.outputs[1].value = 42
    with pytest.raises(VerifyError):
        verify(g)


def test_verifier_shape_check_can_be_skipped():
    g = _broken("recorded shape contradicts the annotation")
    verify(g, check_shapes=False)
    with pytest.raises(VerifyError, match=r"recorded shape \[3, 2\], annotation implies \[2, 3\]"):
        verify(g)


def test_verifier_does_not_check_opaque_shapes():
    g, v = _tiny()
    g.nodes[0].op = "rhino_test.opaque.default"
    g.types[v["y"]] = f32(7)  # anything goes for an op the IR does not know
    g.types[v["loss"]] = f32()
    verify(g)


def test_verifier_accepts_frozen_and_buffers_with_outputs():
    g, v = _tiny()
    b = g.add_input("bn.running_mean", Role.BUFFER, f32(3))
    fz = g.add_input("emb", Role.FROZEN, f32(3))
    g.outputs += [GraphOutput("bn.running_mean", Role.BUFFER, b), GraphOutput("emb", Role.FROZEN, fz)]
    verify(g)


def test_verifier_message_names_the_problem():
    with pytest.raises(VerifyError, match="in-place op aten.mul_.Scalar"):
        verify(_broken("in-place op"))
    with pytest.raises(VerifyError, match="0 loss outputs"):
        verify(_broken("missing loss"))
    with pytest.raises(VerifyError, match="expected a scalar"):
        verify(_broken("non-scalar loss"))
    with pytest.raises(VerifyError, match="before it is defined"):
        verify(_broken("use before definition"))
    with pytest.raises(VerifyError, match="redefines value"):
        verify(_broken("value redefined by a node"))
    with pytest.raises(VerifyError, match="no matching state input"):
        verify(_broken("state output without matching input"))
    with pytest.raises(VerifyError, match="no new value"):
        verify(_broken("state input with no output"))
    with pytest.raises(VerifyError, match="changes type"):
        verify(_broken("state dtype change"))


# -- in-place op names -----------------------------------------------------------------------
@pytest.mark.parametrize("op, inplace", [
    ("aten.add_.Tensor", True), ("aten.relu_.default", True), ("aten.copy_.default", True),
    ("aten.__iand__.Tensor", True), ("aten.__ior__.Scalar", True), ("aten.__ilshift__.Tensor", True),
    ("aten.__and__.Tensor", False), ("aten.__or__.Scalar", False), ("aten.__lshift__.Tensor", False),
    ("aten._foo.default", False), ("aten._softmax.default", False), ("aten.add.Tensor", False),
    ("aten.add.out", True), ("aten.sum.IntList_out", True), ("aten._softmax.out", True),
    ("aten.add", False), ("add_", False), ("prims.add_", False),
])
def test_is_inplace_op(op, inplace):
    assert is_inplace_op(op) is inplace


def test_is_inplace_op_flags_only_mutating_aten_overloads():
    """Against torch's schemas: whatever the naming rule flags really mutates an argument."""
    torch = pytest.importorskip("torch")
    flagged = []
    for name in ["add_", "mul_", "relu_", "copy_", "__iand__", "__ior__", "add", "sum", "_softmax", "__and__",
                 "index_put_", "addmm", "fill_", "zero_", "bernoulli_"]:
        packet = getattr(torch.ops.aten, name)
        for overload in packet.overloads():
            op = f"aten.{name}.{overload}"
            if is_inplace_op(op):
                flagged.append(op)
                assert getattr(packet, overload)._schema.is_mutable, op
    assert "aten.add_.Tensor" in flagged and "aten.add.out" in flagged and "aten.__iand__.Tensor" in flagged


def test_blocks_of_state_names():
    from rhino.ir.modules import ROOT, block_of, value_blocks
    assert block_of("blocks.3.attn.qkv.weight") == "blocks.3"
    assert block_of("opt/blocks.3.mlp.0.bias/exp_avg") == "blocks.3"      # optimizer state: its parameter's
    assert block_of("model.layers.12.self_attn.q_proj.weight") == "model.layers.12"
    assert block_of("enc1.0.weight") == "enc1.0"        # a Sequential of single layers: one layer
    assert block_of("layers.0.0.weight") == "layers.0"
    assert block_of("0.weight") == "0"                  # a top-level Sequential: each layer
    assert block_of("tok.weight") == block_of("x.3") == ROOT
    g = train_step()
    blocks = value_blocks(g)
    state = {i.value for i in g.inputs if i.role is not Role.BATCH}
    assert blocks and not state & set(blocks)            # only values that are not state get a block

"""Dimension annotations: parsing templates and the shape inference they imply."""
from __future__ import annotations

from math import prod

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rhino.ir.annotation import Annotation, ShapeError, infer_shapes, letter_sizes, parse

FAST = settings(max_examples=30, deadline=None)
sizes = st.integers(1, 6)


# -- parse -------------------------------------------------------------------------
def test_parse_matmul():
    ann = parse("m k+, k+ n -> m n", [2, 2])
    assert ann.inputs == ((("m",), ("k",)), (("k",), ("n",)))
    assert ann.outputs == ((("m",), ("n",)),)
    assert ann.reduced == {"k"}
    assert ann.fixed == frozenset()
    assert ann.letters() == ["m", "k", "n"]
    assert ann.reduce_kind == "sum"
    assert str(ann) == "m k+, k+ n -> m n"


def test_parse_batched_matmul_and_reduce_kind():
    ann = parse("b m k+, b k+ n -> b m n", [3, 3], reduce_kind="max")
    assert ann.inputs[0] == (("b",), ("m",), ("k",))
    assert ann.outputs == ((("b",), ("m",), ("n",)),)
    assert ann.reduced == {"k"}
    assert ann.reduce_kind == "max"


@pytest.mark.parametrize("rank", [1, 2, 3, 5])
def test_parse_layer_norm_star(rank):
    ann = parse("* d^, d^, d^ -> * d^", [rank, 1, 1])
    lead = tuple((f"_{i}",) for i in range(rank - 1))
    assert ann.inputs == (lead + (("d",),), (("d",),), (("d",),))
    assert ann.outputs == (lead + (("d",),),)
    assert ann.fixed == {"d"}
    assert ann.reduced == frozenset()
    assert "*" not in ann.letters()


def test_parse_star_takes_count_from_first_starred_input():
    # The first input has no '*': the count comes from the second one.
    ann = parse("v^ d, * -> * d", [2, 3])
    assert ann.inputs == ((("v",), ("d",)), (("_0",), ("_1",), ("_2",)))
    assert ann.outputs == ((("_0",), ("_1",), ("_2",), ("d",)),)
    assert ann.fixed == {"v"}


def test_parse_marked_star_marks_every_expanded_letter():
    ann = parse("*+ d, *+ -> v d", [3, 2], sizes={"v": 7})
    assert ann.reduced == {"_0", "_1"}
    assert ann.sizes == {"v": 7}
    ann = parse("*^ d -> *^ d", [3])
    assert ann.fixed == {"_0", "_1"}


def test_parse_merged_dims():
    ann = parse("(a b) c -> a (b c)", [2])
    assert ann.inputs == ((("a", "b"), ("c",)),)
    assert ann.outputs == ((("a",), ("b", "c")),)
    assert ann.letters() == ["a", "b", "c"]
    assert str(ann) == "(a b) c -> a (b c)"
    # marks inside a merged dim apply to the letter
    ann = parse("(a b+) -> a", [1])
    assert ann.inputs == ((("a", "b"),),)
    assert ann.reduced == {"b"}


def test_parse_reduced_and_fixed_marks():
    ann = parse("a b+ c^ -> a c^", [3])
    assert ann.reduced == {"b"}
    assert ann.fixed == {"c"}
    assert ann.outputs == ((("a",), ("c",)),)
    ann = parse("a b+^ -> a", [2])
    assert ann.reduced == {"b"} and ann.fixed == {"b"}


def test_parse_scalar_output_and_no_inputs():
    ann = parse("k+, k+ -> ", [1, 1])
    assert ann.outputs == ((),)
    ann = parse(" -> ", [])
    assert ann.inputs == () and ann.outputs == ((),)


def test_parse_several_outputs():
    ann = parse("a b -> a, b, a b", [2])
    assert ann.outputs == ((("a",),), (("b",),), (("a",), ("b",)))


def test_parse_errors():
    with pytest.raises(ShapeError):      # wrong number of inputs
        parse("m k+, k+ n -> m n", [2])
    with pytest.raises(ShapeError):      # '*' needs more dims than the tensor has
        parse("* a b -> * a b", [1])
    with pytest.raises(ShapeError):      # '*' only in the output: nothing to expand it from
        parse("a -> * a", [1])
    with pytest.raises(ValueError):
        parse("(a b c -> a", [1])
    with pytest.raises(ValueError):
        parse("() a -> a", [2])


# -- letter_sizes / infer_shapes -----------------------------------------------------
@FAST
@given(m=sizes, k=sizes, n=sizes)
def test_matmul_shapes(m, k, n):
    ann = parse("m k+, k+ n -> m n", [2, 2])
    assert letter_sizes(ann, [(m, k), (k, n)]) == {"m": m, "k": k, "n": n}
    assert infer_shapes(ann, [(m, k), (k, n)]) == [(m, n)]


@FAST
@given(lead=st.lists(sizes, max_size=4), d=sizes)
def test_layer_norm_shapes(lead, d):
    ann = parse("* d^, d^, d^ -> * d^", [len(lead) + 1, 1, 1])
    assert infer_shapes(ann, [(*lead, d), (d,), (d,)]) == [(*lead, d)]


@FAST
@given(a=sizes, b=sizes, c=sizes)
def test_merged_dim_output(a, b, c):
    ann = parse("a b c -> (a b) c, a (b c), (a b c)", [3])
    assert infer_shapes(ann, [(a, b, c)]) == [(a * b, c), (a, b * c), (a * b * c,)]


@FAST
@given(a=sizes, b=sizes, c=sizes)
def test_merged_dim_input_sized_from_other_dims(a, b, c):
    # 'b' is known from the second input, so 'a' follows from the merged dim.
    ann = parse("(a b) c, b -> a (b c)", [2, 1])
    assert letter_sizes(ann, [(a * b, c), (b,)]) == {"a": a, "b": b, "c": c}
    assert infer_shapes(ann, [(a * b, c), (b,)]) == [(a, b * c)]
    # ... or from sizes given with the annotation
    ann = parse("(a b) c -> a (b c)", [2], sizes={"b": b})
    assert infer_shapes(ann, [(a * b, c)]) == [(a, b * c)]


@FAST
@given(a=sizes, b=sizes, c=sizes)
def test_merged_dims_sized_through_each_other(a, b, c):
    # 'c' sizes (b c), which sizes 'b', which sizes (a b): the order of the
    # merged dims among the inputs must not matter.
    ann = parse("(a b), (b c), c -> a b c", [1, 1, 1])
    assert infer_shapes(ann, [(a * b,), (b * c,), (c,)]) == [(a, b, c)]


def test_merged_dim_errors():
    ann = parse("(a b) c -> a (b c)", [2])
    with pytest.raises(ShapeError):      # two unknown parts
        letter_sizes(ann, [(6, 2)])
    ann = parse("(a b) c, b -> a (b c)", [2, 1])
    with pytest.raises(ShapeError):      # 7 is not a multiple of b=2
        letter_sizes(ann, [(7, 3), (2,)])
    ann = parse("(a b), a, b -> a b", [1, 1, 1])
    with pytest.raises(ShapeError):      # parts known and contradicting
        letter_sizes(ann, [(7,), (2,), (3,)])
    assert infer_shapes(ann, [(6,), (2,), (3,)]) == [(2, 3)]


def test_contradicting_sizes():
    ann = parse("m k+, k+ n -> m n", [2, 2])
    with pytest.raises(ShapeError, match="'k'"):
        infer_shapes(ann, [(2, 3), (4, 5)])
    # a size given with the annotation counts too
    ann = parse("a b -> a b", [2], sizes={"b": 3})
    with pytest.raises(ShapeError):
        infer_shapes(ann, [(2, 4)])
    assert infer_shapes(ann, [(2, 3)]) == [(2, 3)]


def test_wrong_rank_and_count():
    ann = parse("m k+, k+ n -> m n", [2, 2])
    with pytest.raises(ShapeError):
        infer_shapes(ann, [(2, 3, 1), (3, 5)])
    with pytest.raises(ShapeError):
        infer_shapes(ann, [(2, 3)])
    # '*' was expanded for rank 3; a rank-4 tensor no longer fits
    ann = parse("* d^, d^, d^ -> * d^", [3, 1, 1])
    with pytest.raises(ShapeError):
        infer_shapes(ann, [(1, 2, 3, 4), (4,), (4,)])
    # a second '*' input of another rank does not fit either
    ann = parse("*, * -> *", [2, 1])
    with pytest.raises(ShapeError):
        infer_shapes(ann, [(2, 3), (3,)])


def test_unsized_output_letter():
    ann = parse("a -> a v", [1])
    with pytest.raises(ShapeError, match="'v'"):
        infer_shapes(ann, [(3,)])
    ann = parse("a -> a v", [1], sizes={"v": 5})
    assert infer_shapes(ann, [(3,)]) == [(3, 5)]


def test_absent_output_and_scalars():
    ann = Annotation(inputs=((("a",),),), outputs=((("a",),), None, ()))
    assert infer_shapes(ann, [(4,)]) == [(4,), None, ()]
    ann = parse("k+, k+ -> ", [1, 1])
    assert infer_shapes(ann, [(5,), (5,)]) == [()]


@FAST
@given(shape=st.lists(sizes, min_size=1, max_size=5), data=st.data())
def test_reduced_letter_sizes_match_input(shape, data):
    """Random annotation over one input: every output dim has the size of its letters."""
    names = [f"x{i}" for i in range(len(shape))]
    keep = data.draw(st.lists(st.sampled_from(range(len(shape))), unique=True))
    text = " ".join(n + ("+" if i not in keep else "") for i, n in enumerate(names)) + " -> " + \
        " ".join(names[i] for i in keep)
    ann = parse(text, [len(shape)])
    assert ann.reduced == {names[i] for i in range(len(shape)) if i not in keep}
    assert infer_shapes(ann, [shape]) == [tuple(shape[i] for i in keep)]
    assert prod(infer_shapes(ann, [shape])[0]) == prod(shape[i] for i in keep)

"""Batched linear algebra (registered on import): every op acts on the last two dims of its matrices, one
batch entry at a time, so the leading (batch) dims of the first input pass through and everything else is
fixed. A tensor whose leading dims differ from the first input's (broadcast batches) is fixed whole."""
from __future__ import annotations

from .annotation import Annotation
from .registry import InputLayout, OpCall, OpKind, register
from .rules import NewLetters, letters


def _cubic(call: OpCall) -> int:
    """~n^3 per matrix (a factorisation or an inverse), times the batch."""
    t = call.in_types[0]
    n = t.shape[-1] if t.rank >= 2 else 1
    return (t.numel // max(n * n, 1)) * n ** 3 if t.rank >= 2 else t.numel


def batched_matrix_rule(call: OpCall) -> Annotation:
    """``*b m n`` (and the other operands and results sharing ``*b``): ``*b`` free, the rest fixed."""
    first = call.in_types[0]
    # the first input is a matrix (A, LU, the right-hand side of cholesky_solve) or, for the error check, the
    # info tensor of the batch alone
    batch_rank = first.rank if call.op.startswith("aten._linalg_check_errors") else max(first.rank - 2, 0)
    batch = first.shape[:batch_rank]
    names = letters("b", batch_rank)
    new = NewLetters("f")

    def spec(t) -> tuple:
        if t.rank >= batch_rank and tuple(t.shape[:batch_rank]) == tuple(batch):
            return tuple((n,) for n in names) + tuple((new(s),) for s in t.shape[batch_rank:])
        return tuple((new(s),) for s in t.shape)

    ins = tuple(spec(t) for t in call.in_types)
    outs = tuple(spec(t) if t is not None else None for t in call.out_types)
    fixed = frozenset(x for sp in (*ins, *(o for o in outs if o is not None)) for d in sp for x in d
                      if x not in names)
    return Annotation(ins, outs, fixed=fixed, sizes=new.sizes)


register("""
aten.linalg_inv_ex.default aten._linalg_solve_ex.default
aten.linalg_cholesky_ex.default aten.cholesky_solve.default aten.linalg_solve_triangular.default
aten._linalg_eigh.default aten.linalg_lu_solve.default
aten.linalg_lu_factor_ex.default aten.linalg_matrix_exp.default aten.linalg_qr.default
""".split(), OpKind.INDEX, batched_matrix_rule, flops=lambda call, ann, sizes: _cubic(call))
# they factor A^T where A is C-contiguous, and A otherwise; their backward's solves follow the traced layout, which
# capture rewrites for a C-contiguous A (capture.trace._det_solves_for_contiguous): always called on one
register("aten._linalg_det.default aten._linalg_slogdet.default", OpKind.INDEX, batched_matrix_rule,
         flops=lambda call, ann, sizes: _cubic(call), input_layout=InputLayout.CONTIGUOUS)
# its kernel asserts that the error codes are contiguous (registry docstring: input_layout)
register("aten._linalg_check_errors.default", OpKind.INDEX, batched_matrix_rule,
         flops=lambda call, ann, sizes: _cubic(call), input_layout=InputLayout.CONTIGUOUS)

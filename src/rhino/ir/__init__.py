"""The framework-independent IR (no torch import)."""
from .annotation import Annotation, ShapeError, infer_shapes, parse
from .graph import Graph, GraphInput, GraphOutput, Node, Ref, Role
from .registry import OpDef, OpKind, annotate, bytes_of, call_of, flops_of, is_known, lookup
from .types import DType, TensorType
from .verify import VerifyError, verify

__all__ = ["Annotation", "ShapeError", "infer_shapes", "parse", "Graph", "GraphInput", "GraphOutput", "Node",
           "Ref", "Role", "OpDef", "OpKind", "annotate", "bytes_of", "call_of", "flops_of", "is_known", "lookup",
           "DType", "TensorType", "VerifyError", "verify"]

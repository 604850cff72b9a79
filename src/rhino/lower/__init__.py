"""Lowering: IR -> torch programs."""
from .execute import StepProgram
from .fx import lower, resolve_op

__all__ = ["StepProgram", "lower", "resolve_op"]

"""Rhino: capture a PyTorch training step into one IR, plan it, run it."""
__version__ = "0.1.0"

__all__ = ["__version__"]

"""Automatic plan search (pure Python, never imports torch): the strategy space, cones and tied layers,
the O2 integer program (CP-SAT), the O1 critical-node segments, the outer search over mesh shapes and
recomputation, and the readable report. ``search(graph, cluster)`` is the entry point."""
from .options import Level, SearchOptions
from .outer import NoPlanFits, SearchResult, candidate_meshes, search

__all__ = ["Level", "SearchOptions", "SearchResult", "NoPlanFits", "candidate_meshes", "search"]

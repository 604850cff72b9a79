"""Greedy sharding propagation: choose each node's strategy from its inputs' shardings.

Inputs: the graph, a mesh, the shardings of some graph inputs, and a set of *lazy* inputs whose
sharding is decided by their first consumer (through chains of view ops and dtype casts, so a weight
cast to bf16 under autocast is split like the weight itself), so that, e.g., a weight
takes whatever split its matmul needs. Nodes are visited in program order; for each, every
strategy (per mesh axis: replicate, split one legal letter, or pass a Partial through a linear op)
is scored by

    cost = bytes moved to bring the inputs to the required shardings
         + bytes to bring a state output to its state's sharding
         + an *introduction penalty* when an output is sharded on an axis where no input was
           (the bytes of gathering it later),

and the cheapest wins; ties go to fewer collectives, then to fewer split axes (replication
introduces no later gathers). An optional ``rule`` may restrict the letters of a node (the
Megatron preset uses one for matmuls with lazy weights).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

from ..ir.analysis import update_feeders
from ..ir.graph import Graph, Node, Ref, Role, STATE_ROLES
from ..ir.registry import OpKind, annotate, call_of, call_signature, lookup
from ..ir.annotation import letter_sizes
from ..ir.casts import is_cast
from .mesh import Mesh
from .placement import Partial, Replicate, Shard, Sharding, replicated
from .plan import ShardingPlan, node_shardings
from .redistribute import comm_bytes, plan_redistribution
from .rules import StrategyError, candidate_letters, partial_inputs, shardings_for
from .vocab import is_passthrough, passthrough, split_letter, strided

__all__ = ["Propagator", "MatmulRule"]

# rule(propagator, node, annotation, axis) -> allowed letters on that axis, or None for no restriction
MatmulRule = Callable[["Propagator", Node, object, int], "list | None"]


@dataclass
class _Lazy:
    input_name: str | None = None
    node: Node | None = None


@dataclass
class Propagator:
    graph: Graph
    mesh: Mesh
    fixed: dict[str, Sharding]
    lazy_inputs: set[str] = field(default_factory=set)
    rule: MatmulRule | None = None
    # lazy input -> the input whose sharding it takes once that one is decided (optimizer state
    # follows its parameter)
    follows: dict[str, str] = field(default_factory=dict)
    # input -> the sharding it is stored in when that differs from the one its consumers see (``fixed``,
    # default replicated): a ZeRO-3 parameter is stored split and all-gathered before use. The plan
    # records the stored sharding; the updated state is brought back to it.
    at_rest: dict[str, Sharding] = field(default_factory=dict)
    # rule ``reduce_before_widening``: a Partial input of an op whose output is of a wider dtype is reduced
    # before it, not passed through (under autocast the row-parallel matmul's bf16 output is all-reduced,
    # as Megatron-LM does, instead of the fp32 sum it is added to: half the bytes); see ``_widens``
    reduce_before_widening: bool = True
    #: ZeRO over the mesh axis ``zero_axis`` for lazy inputs (tensor parallelism beside ZeRO, as Megatron-LM's
    #: distributed optimizer runs): once a lazy input's sharding is decided, ``_zero_sharding`` adds a split
    #: along that axis; an optimizer state (``zero_level`` >= 1) is then stored and used split, so its update
    #: runs on the shard; a parameter (``zero_level`` 3) is stored split and used as decided (gathered before
    #: use). Non-lazy inputs take ZeRO from ``fixed`` and ``at_rest``. Nodes that only feed the state update
    #: pay no introduction penalty on ``zero_axis`` (the optimizer state is split there anyway, and the
    #: gather back is the parameter's, ZeRO's own), so a gradient is reduce-scattered into the shard the
    #: update runs on rather than all-reduced (SGD's weight decay ``grad + wd * param`` comes before any
    #: optimizer state: 1.5x DDP's bytes before, 1x after).
    zero_axis: int | None = None
    zero_level: int = 0
    #: Values whose Partial is not passed through a linear op (``reduce_once``: found by a first run that
    #: both passed such a value on and reduced it for another consumer, so the sum was reduced twice).
    no_pass: frozenset = frozenset()
    #: Remember each decision by what it depends on (``_decision_key``: the call signature, the strategy
    #: options, and the shardings, availability and laziness of the inputs and the wanted state outputs),
    #: so that identical layers are scored once (exact: the same key gives the same scores). Off: every node
    #: is scored.
    memo_decisions: bool = True

    def __post_init__(self) -> None:
        self.actual: dict[int, Sharding] = {}
        self.lazy: dict[int, _Lazy] = {}
        self.inputs: dict[str, Sharding] = {}
        self.strategies: dict[str, tuple] = {}
        self._cost_cache: dict[tuple, tuple[int, int]] = {}
        # shardings a value already exists in (produced, or redistributed for an earlier consumer:
        # the lowering keeps one copy per value and sharding)
        self.available: dict[int, set] = {}
        self.state_input = {i.name: i for i in self.graph.inputs if i.role in STATE_ROLES}
        self.output_state = {o.value: o.name for o in self.graph.outputs if o.role in STATE_ROLES}
        self.users = self.graph.users()
        self._ns_cache: dict[tuple, object] = {}   # (call signature, strategy) -> NodeShardings | error
        self._decisions: dict[tuple, tuple] = {}   # _decision_key -> (strategy, NodeShardings)
        self._ann_cache: dict[tuple, tuple] = {}   # call signature -> (annotation, letter sizes)
        self._letters: dict[tuple, list] = {}      # (call signature, axis size) -> candidate letters
        self.scored = 0                            # nodes scored (not remembered): for the tests
        self.total = 0                             # the chosen strategies' costs, summed
        self._parent: dict[int, int] = {}          # a Partial value passed on -> the input it was passed from
        self._reduced: dict[int, set[int]] = {}    # origin (``_chain``'s end) -> the values made from it reduced
        self._to_optimizer = update_feeders(self.graph)

    # -- public ---------------------------------------------------------------------------
    def run(self) -> ShardingPlan:
        rep = replicated(self.mesh)
        for inp in self.graph.inputs:
            if inp.name in self.lazy_inputs:
                self.lazy[inp.value] = _Lazy(input_name=inp.name)
            else:
                sh = self.fixed.get(inp.name, rep)
                self.inputs[inp.name] = self.at_rest.get(inp.name, sh)
                self.actual[inp.value] = sh
        for vid in self.graph.constants:
            self.actual[vid] = rep
        for node in self.graph.nodes:
            refs = node.input_refs()
            opdef = lookup(node.op)
            if (opdef is not None and (opdef.kind is OpKind.VIEW or is_cast(node)) and len(refs) == 1
                    and refs[0].id in self.lazy and len(node.outputs) == 1):
                self.lazy[node.outputs[0]] = _Lazy(node=node)
                continue
            self._decide(node)
        for vid in list(self.lazy):
            if vid in self.lazy:
                self._resolve(vid, rep)
        return ShardingPlan(self.mesh, self.inputs, self.strategies)

    def input_param(self, vid: int) -> str | None:
        """The parameter a lazy value is a view of, if any."""
        lz = self.lazy.get(vid)
        while lz is not None and lz.node is not None:
            lz = self.lazy.get(lz.node.input_refs()[0].id)
        if lz is None or lz.input_name is None:
            return None
        return lz.input_name if self.state_input.get(lz.input_name) and \
            self.state_input[lz.input_name].role is Role.PARAM else None

    def _widens(self, node: Node, partial_refs: list[Ref]) -> bool:
        """Whether ``node``'s output is of a wider dtype than one of its Partial inputs (a bf16 matmul result
        added to an fp32 residual stream under autocast, or cast to fp32), unless the node forms a parameter's
        gradient (``ir.analysis.update_feeders``): that is reduced in its wider type, as DDP reduces fp32 ``.grad``."""
        outs = [v for v in node.outputs if v is not None]
        if not outs:
            return False
        wide = max(self.graph.types[v].dtype.itemsize for v in outs)
        if not any(self.graph.types[r.id].dtype.itemsize < wide for r in partial_refs):
            return False
        return node.name not in self._to_optimizer

    # -- deciding a node ------------------------------------------------------------------
    def _options(self, node: Node, ann, sizes, axis: int, sig: tuple | None = None) -> list:
        n = self.mesh.sizes[axis]
        if n == 1:
            return [None]
        if ann is None:
            return [None]
        allowed = self.rule(self, node, ann, axis) if self.rule else None
        letters = self._letters.get((sig, n)) if sig is not None else None
        if letters is None:
            letters = candidate_letters(ann, sizes, n)
            if sig is not None:
                self._letters[(sig, n)] = letters
        if allowed is not None:
            return [x for x in allowed if x is None or self._divides(x, letters, sizes, n)] or [None]
        opts: list = [None] + letters
        refs = node.input_refs()
        opts += self._strided_options(refs, ann, sizes, axis, letters)
        partial_at = [k for k, r in enumerate(refs)
                      if r.id in self.actual and isinstance(self.actual[r.id][axis], Partial)]
        opdef = lookup(node.op)
        if any(refs[k].id in self.no_pass for k in partial_at):
            partial_at = []
        if partial_at and not (self.reduce_before_widening and self._widens(node, [refs[k] for k in partial_at])):
            for group in partial_inputs(node.op, opdef is not None and opdef.kind is OpKind.VIEW, len(refs),
                                        node.args, node.kwargs, self.graph.types[refs[0].id].dtype):
                # only where the inputs are Partial already: turning a replicated input into a
                # Partial one would leave a Partial value for later consumers to reduce again
                if set(partial_at) == set(group):
                    opts.append(passthrough(group, len(refs)))
        return opts

    @staticmethod
    def _divides(entry: str, letters: list[str], sizes: dict, n: int) -> bool:
        """A rule's split ``x`` or ``x/k`` can be taken on ``n`` devices: ``x`` splits, and into ``k * n``
        parts (a fused weight chunked in 4 whose chunks ``n`` does not divide is replicated instead)."""
        letter, blocks = split_letter(entry)
        return letter in letters and sizes[letter] % (blocks * n) == 0

    def _strided_options(self, refs, ann, sizes, axis: int, letters: list[str]) -> list[str]:
        """``"x/k"`` entries that keep an input's strided shard (blocks beyond its dim's own parts)."""
        out = []
        for k, ref in enumerate(refs):
            have = self.actual.get(ref.id)
            if have is None or not isinstance(have[axis], Shard) or have[axis].blocks == 1 or k >= len(ann.inputs):
                continue
            p = have[axis]
            if p.dim >= len(ann.inputs[k]):
                continue
            prefix = 1
            for x in ann.inputs[k][p.dim]:
                if p.blocks % prefix == 0 and x in letters and p.blocks // prefix > 1:
                    entry = strided(x, p.blocks // prefix)
                    if sizes[x] % (p.blocks // prefix * self.mesh.sizes[axis]) == 0 and entry not in out:
                        out.append(entry)
                prefix *= sizes[x]
        return out

    def _decide(self, node: Node) -> None:
        for ref in node.input_refs():
            lz = self.lazy.get(ref.id)
            leader = self.follows.get(lz.input_name) if lz is not None and lz.input_name else None
            if leader is not None and leader in self.inputs:
                self._resolve(ref.id, self.inputs[leader])
        sig = call_signature(self.graph, node)
        hit = self._ann_cache.get(sig)     # equal calls have equal annotations (``call_signature``)
        if hit is None:
            call = call_of(self.graph, node)
            ann = annotate(call)
            hit = self._ann_cache[sig] = (ann, letter_sizes(ann, [t.shape for t in call.in_types])
                                          if ann is not None else {})
        ann, sizes = hit
        options = [self._options(node, ann, sizes, a, sig) for a in range(self.mesh.ndim)]
        refs = node.input_refs()
        key = self._decision_key(node, refs, sig, options) if self.memo_decisions else None
        hit = self._decisions.get(key) if key is not None else None
        if hit is None:
            hit = self._best(node, refs, sig, options)
            if key is not None:
                self._decisions[key] = hit
        strategy, ns, cost = hit
        self.total += cost
        for ref, req in zip(refs, ns.inputs):
            if ref.id in self.lazy:
                self._resolve(ref.id, req)
            have = self.actual.get(ref.id)
            for a, p in enumerate(have or ()):
                if isinstance(p, Partial):
                    if isinstance(req[a], Partial):
                        passed = [v for v, sh in zip(node.outputs, ns.outputs)
                                  if v is not None and sh is not None and isinstance(sh[a], Partial)]
                        self._parent.update((v, ref.id) for v in passed)
                    else:
                        self._reduced.setdefault(self._chain(ref.id)[-1], set()).add(ref.id)
            self.available.setdefault(ref.id, set()).add(req)
        self.strategies[node.name] = strategy
        for vid, sh in zip(node.outputs, ns.outputs):
            if vid is not None:
                self.actual[vid] = sh

    def _decision_key(self, node: Node, refs: list[Ref], sig: tuple, options: list) -> tuple:
        """Everything ``_best`` reads besides the graph's types (in ``sig``): per input its laziness, sharding
        and the shardings it is available in; per output the sharding its state is wanted in."""
        ins = tuple((r.id in self.lazy, self.actual.get(r.id), frozenset(self.available.get(r.id, ())))
                    for r in refs)
        outs = tuple(None if v is None else (self.inputs.get(self.output_state.get(v)) if v in self.output_state
                                              else None, frozenset(self.available.get(v, ())))
                     for v in node.outputs)
        return (sig, tuple(tuple(o) for o in options), ins, outs)

    def _best(self, node: Node, refs: list[Ref], sig: tuple, options: list) -> tuple:
        """The cheapest legal strategy of ``node`` and its shardings (module docstring)."""
        self.scored += 1
        best = None
        # what every strategy's score shares (the state changes only once a strategy is chosen)
        arrived = [(r.id, self.actual[r.id]) for r in refs if r.id in self.actual]
        had = [any(isinstance(sh[axis], Shard) for _, sh in arrived) for axis in range(self.mesh.ndim)]
        lazy_at = [k for k, r in enumerate(refs) if r.id in self.lazy]
        moved = [(k, r.id, self.actual[r.id]) for k, r in enumerate(refs) if r.id not in self.lazy]
        chosen = list(itertools.product(*options))
        # a rule's choices (``_options``) may all be illegal here (a split the local size does not divide):
        # replication, legal everywhere, is then the fallback
        fallback = [] if all(None in o for o in options) else [tuple(None for _ in options)]
        for idx, strategy in enumerate(chosen + fallback):
            if idx == len(chosen) and best is not None:
                break
            ns = self._ns_cache.get((sig, strategy))
            if ns is None:
                try:
                    ns = node_shardings(self.graph, node, strategy, self.mesh)
                except (StrategyError, ValueError):
                    ns = False
                self._ns_cache[(sig, strategy)] = ns
            if ns is False:
                continue
            if any(is_passthrough(s) for s in strategy) and not self._passes_ok(refs, ns):
                continue
            key = self._score(node, moved, ns, strategy, had, lazy_at) + (idx,)
            if best is None or key < best[0]:
                best = (key, strategy, ns)
        if best is None:  # nothing legal (should not happen: all-replicate is always legal)
            raise AssertionError(f"no legal strategy for {node.name}")
        return best[1], best[2], best[0][0]

    def reduced_twice(self) -> frozenset:
        """Where Partial values of which two or more were reduced forked: of each Partial value from which two
        or more values were reduced (the value itself and values linear ops made from it, passed through; e.g. a
        gradient reduced for one consumer and its product with a momentum reduced for another), the last value
        on the way to all of them. Reducing it once there and passing on its reduced value may move fewer
        bytes (rerun with them in ``no_pass``); there, not where the Partial was made, so that what comes
        before the fork (a gradient's transpose, the sum of a tied weight's two gradients) still passes it on
        and the one reduction waits until the update reads it."""
        out = set()
        for origin, reduced in self._reduced.items():
            if len(reduced) < 2:
                continue
            chains = [self._chain(v) for v in sorted(reduced)]
            common = set.intersection(*(set(c) for c in chains))
            out.add(next(v for v in chains[0] if v in common))
        return frozenset(out)

    def _chain(self, v: int) -> list[int]:
        """``v``, the value it was passed from, and so on back to the Partial value where it was made."""
        out = [v]
        while v in self._parent:
            v = self._parent[v]
            out.append(v)
        return out

    def _passes_ok(self, refs: list[Ref], ns) -> bool:
        for ref, req in zip(refs, ns.inputs):
            have = self.actual.get(ref.id)
            for a, p in enumerate(req):
                if isinstance(p, Partial) and (have is None or not isinstance(have[a], Partial)
                                               or have[a].op.value not in ("sum",)):
                    return False
        return True

    def _score(self, node: Node, moved: list[tuple], ns, strategy, had: list[bool], lazy_at: list[int]) -> tuple:
        """``moved``: (position, value, sharding) of each input that is not lazy; ``had``, ``lazy_at``:
        ``_introduction_penalty``'s."""
        cost = steps = 0
        width = len(ns.inputs)
        for k, vid, have in moved:
            if k < width:
                c, s = self._move(vid, have, ns.inputs[k])
                cost, steps = cost + c, steps + s
        for vid, sh in zip(node.outputs, ns.outputs):
            if vid is None or sh is None:
                continue
            name = self.output_state.get(vid)
            if name is not None:
                want = self.inputs.get(name)
                if want is not None and want != sh:
                    c, s = self._move(vid, sh, want)
                    cost, steps = cost + c, steps + s
        cost += self._introduction_penalty(ns, node, had, lazy_at)
        splits = sum(1 for s in strategy if s is not None)
        return (cost, steps, splits)

    def _introduction_penalty(self, ns, node: Node, had: list[bool], lazy_at: list[int]) -> int:
        """``had[axis]``: an input that arrived is split on ``axis``; ``lazy_at``: positions of lazy inputs."""
        penalty = 0
        zero_free = self.zero_axis if self.zero_level >= 1 and node.name in self._to_optimizer else None
        for axis in range(self.mesh.ndim):
            n = self.mesh.sizes[axis]
            if axis == zero_free or had[axis] or \
                    any(isinstance(ns.inputs[k][axis], Shard) for k in lazy_at if k < len(ns.inputs)):
                continue
            for vid, sh in zip(node.outputs, ns.outputs):
                if vid is not None and sh is not None and isinstance(sh[axis], Shard):
                    penalty += self.graph.types[vid].nbytes * (n - 1) // n
        return penalty

    def _move(self, vid: int, src: Sharding, dst: Sharding) -> tuple[int, int]:
        if src == dst or dst in self.available.get(vid, ()):
            return 0, 0
        t = self.graph.types[vid]
        key = (t.shape, t.dtype, src, dst)
        hit = self._cost_cache.get(key)
        if hit is None:
            steps = plan_redistribution(t.shape, src, dst, self.mesh)
            hit = (comm_bytes(t.shape, t.dtype.itemsize, steps, src, self.mesh), len(steps))
            self._cost_cache[key] = hit
        return hit

    # -- lazy values ----------------------------------------------------------------------
    def _resolve(self, vid: int, want: Sharding) -> None:
        lz = self.lazy.pop(vid)
        if any(isinstance(p, Partial) for p in want):
            want = tuple(Replicate() if isinstance(p, Partial) else p for p in want)
        if lz.input_name is not None:
            role = self.state_input[lz.input_name].role if lz.input_name in self.state_input else None
            stored = self._zero_sharding(vid, want, role)
            self.inputs[lz.input_name] = stored
            self.actual[vid] = stored if role is Role.OPT_STATE else want
            return
        node = lz.node
        call = call_of(self.graph, node)
        ann = annotate(call)
        sizes = letter_sizes(ann, [t.shape for t in call.in_types])
        source = node.input_refs()[0].id
        # the view's source may have been resolved first, by another input of the same consumer (S - S.t()):
        # the view then follows the source's sharding, and the consumer redistributes what it gets if it must
        resolved = source not in self.lazy
        strategy = self._strategy_producing(ann, sizes, self.actual[source], ann.inputs[0]) if resolved else \
            self._strategy_producing(ann, sizes, want)
        try:
            ns = shardings_for(ann, [t.shape for t in call.in_types], strategy, self.mesh)
        except (StrategyError, ValueError):
            strategy = (None,) * self.mesh.ndim
            ns = shardings_for(ann, [t.shape for t in call.in_types], strategy, self.mesh)
        self.strategies[node.name] = strategy
        if not resolved:
            self._resolve(source, ns.inputs[0])
        self.actual[vid] = ns.outputs[0]

    def _zero_sharding(self, vid: int, want: Sharding, role: Role | None) -> Sharding:
        """``want`` split along ``zero_axis`` too (the first dim whose local size it divides) where ZeRO
        shards an input of this role and ``want`` leaves that axis replicated; else ``want``."""
        axis = self.zero_axis
        level = {Role.OPT_STATE: 1, Role.PARAM: 3}.get(role)
        if axis is None or level is None or self.zero_level < level or not isinstance(want[axis], Replicate):
            return want
        n = self.mesh.sizes[axis]
        local = list(self.graph.types[vid].shape)
        for a, p in enumerate(want):
            if isinstance(p, Shard) and p.dim < len(local):
                local[p.dim] //= self.mesh.sizes[a]
        split = {p.dim: p.blocks for p in want if isinstance(p, Shard)}
        # a dim no other axis splits first, then one split in plain (not strided) parts
        for d in sorted(range(len(local)), key=lambda d: d in split):
            if local[d] >= n and local[d] % n == 0 and split.get(d, 1) == 1:
                return tuple(Shard(d) if a == axis else p for a, p in enumerate(want))
        return want

    def _strategy_producing(self, ann, sizes: dict, want: Sharding, dims=None) -> tuple:
        """The view's strategy whose output sharding is ``want`` (a strided shard gives ``"x/k"``); with ``dims``
        (``ann.inputs[0]``), the strategy taking an input sharded as ``want``."""
        dims = ann.outputs[0] if dims is None else dims
        local = dict(sizes)
        out = []
        for axis, p in enumerate(want):
            entry = None
            if isinstance(p, Shard):
                n = self.mesh.sizes[axis]
                prefix = 1
                for x in dims[p.dim]:
                    if p.blocks % prefix == 0 and x not in ann.fixed and local[x] % (n * (p.blocks // prefix)) == 0:
                        entry = strided(x, p.blocks // prefix)
                        local[x] //= n
                        break
                    prefix *= local[x]
            out.append(entry)
        return tuple(out)

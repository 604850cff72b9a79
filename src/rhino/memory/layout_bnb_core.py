"""Compiled core of ``layout_bnb``: the depth-first search as one loop over an explicit stack (numba).

The search and its rules are those of ``layout_bnb``'s docstring; this file only holds their
compiled form. Everything is flat ``int64`` arrays in preorder labels (``label == static preorder
index``):

  P  static: sizes ``Z``, alignments ``AL``, section ranges ``SLO``/``SHI``, time-neighbours and the
     neighbours a buffer is "out" of (``enclosing_first``) as CSR, ``shift_ok``, ``twin``, section
     members as CSR, buffers sorted by first section (``by_slo`` with ``slo_ptr``), the preorder
     keys ``KW``/``KA``/``KZ`` and the preorder's key codes ``pcodes``.
  M  state: ``mo``, ``un``, ``out_left``, per section ``top``/``total``, ``cuts`` (unplaced buffers
     crossing each section boundary), ``sol``, ``rank`` (the tie-break; relabelled per sub-problem
     with ``dynamic_preorder``), per section ``wit`` (an unallocated_floor witness, a hint).
  T  the trail (one record per placement or re-ranking, with undo logs) and the frame stack.
  G  growable pools: candidates and old ranks.
  C  the nogood cache: open addressing, 4 probes, two 64-bit hashes per key; a full probe window
     overwrites its first slot (forgetting a nogood is sound).

A part of the problem is a section range ``[a, b)``: no unplaced buffer crosses ``a`` or ``b``, so
its unplaced buffers are those whose first section lies in it. ``run`` returns ``LIMIT`` when the
node count reaches ``limit`` (the state is kept: calling it again with a higher limit resumes),
``GROW`` when a pool needs to grow (``grow_pools``, then call again), else ``FOUND``/``INFEASIBLE``.
"""
from __future__ import annotations

import numba
import numpy as np

LIMIT, FOUND, INFEASIBLE, GROW = 0, 1, 2, 3

# option bits (LayoutOptions field names)
CANONICAL, DOMINANCE, SECTION_INFERENCE, UNALLOCATED_FLOOR = 1, 2, 4, 8
MONOTONIC_FLOOR, HATLESS, ENCLOSING_FIRST, IDENTICAL_ORDER = 16, 32, 64, 128
DECOMPOSITION, NOGOOD_CACHE, DYNAMIC_PREORDER = 256, 512, 1024

# preorder key codes
KEY_W, KEY_A, KEY_T, KEY_Z = 0, 1, 2, 3

# actions of the loop, frame kinds
_ENTER, _NEXT, _PIECE, _RET = 0, 1, 2, 3
_SEARCH, _FORCED, _SPLIT = 0, 1, 2

# st slots
_ACT, _PA, _PB, _PSUB, _PLO, _PLK, _PSIG = 0, 1, 2, 3, 4, 5, 6
_DEPTH, _TL, _CT, _PT, _NODES, _RETV, _MT, _TT, _RT = 7, 8, 9, 10, 11, 12, 13, 14, 15
ST_SIZE = 16
# the slots the driver (layout_bnb.py) reads and sets: nodes searched, the part [a, b) of the sections, its
# sub-part flag and link
ST_NODES, ST_PART_A, ST_PART_B, ST_PART_SUB, ST_PART_LINK = _NODES, _PA, _PB, _PSUB, _PLK

_BIG = np.int64(1) << 62
_K1 = np.uint64(0xBF58476D1CE4E5B9)
_K2 = np.uint64(0x94D049BB133111EB)
_K3 = np.uint64(0x9E3779B97F4A7C15)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


@numba.njit(cache=True)
def _mix(x):
    """splitmix64's finaliser."""
    x = (x ^ (x >> _S30)) * _K1
    x = (x ^ (x >> _S27)) * _K2
    return x ^ (x >> _S31)


@numba.njit(cache=True)
def _place(k, o, P, M, T, st, flags):
    """Place ``k`` at ``o`` (a trail record with undo logs); returns the section range to check."""
    Z, AL, SLO, SHI, ov_ptr, ov_idx, io_ptr, io_idx = P[0], P[1], P[2], P[3], P[4], P[5], P[6], P[7]
    mo, un, out_left, top, total, cuts, sol = M[0], M[1], M[2], M[3], M[4], M[5], M[6]
    tr_k, tr_a, tr_b, mo_log_i, mo_log_v, top_log = T[0], T[1], T[2], T[4], T[5], T[6]
    h = o + Z[k]
    tl, mt, tt = st[_TL], st[_MT], st[_TT]
    tr_k[tl], tr_a[tl], tr_b[tl] = k, mt, tt
    st[_TL] = tl + 1
    x, y = SLO[k], SHI[k]
    for q in range(ov_ptr[k], ov_ptr[k + 1]):
        j = ov_idx[q]
        if un[j] and mo[j] < h:
            mo_log_i[mt], mo_log_v[mt] = j, mo[j]
            mt += 1
            mo[j] = (h + AL[j] - 1) // AL[j] * AL[j]
            x, y = min(x, SLO[j]), max(y, SHI[j])
    for s in range(SLO[k], SHI[k]):
        top_log[tt] = top[s]
        tt += 1
        top[s] = h
        total[s] -= Z[k]
    un[k] = 0
    sol[k] = o
    if flags & ENCLOSING_FIRST:
        for q in range(io_ptr[k], io_ptr[k + 1]):
            out_left[io_idx[q]] -= 1
    if flags & DECOMPOSITION:
        for s in range(SLO[k], SHI[k] - 1):
            cuts[s] -= 1
    st[_MT], st[_TT] = mt, tt
    return x, y


@numba.njit(cache=True)
def _undo_to(mark, P, M, T, G, st, flags):
    """Pop trail records (placements and re-rankings) down to length ``mark``."""
    Z, SLO, SHI, io_ptr, io_idx, by_slo, slo_ptr = P[0], P[2], P[3], P[6], P[7], P[12], P[13]
    mo, un, out_left, top, total, cuts, rank = M[0], M[1], M[2], M[3], M[4], M[5], M[7]
    tr_k, tr_a, tr_b, tr_c, mo_log_i, mo_log_v, top_log = T[0], T[1], T[2], T[3], T[4], T[5], T[6]
    rlog = G[2]
    tl = st[_TL]
    while tl > mark:
        tl -= 1
        k = tr_k[tl]
        if k >= 0:
            for q in range(st[_MT] - 1, tr_a[tl] - 1, -1):
                mo[mo_log_i[q]] = mo_log_v[q]
            st[_MT] = tr_a[tl]
            q = tr_b[tl]
            for s in range(SLO[k], SHI[k]):
                top[s] = top_log[q]
                q += 1
                total[s] += Z[k]
            st[_TT] = tr_b[tl]
            un[k] = 1
            if flags & ENCLOSING_FIRST:
                for q in range(io_ptr[k], io_ptr[k + 1]):
                    out_left[io_idx[q]] += 1
            if flags & DECOMPOSITION:
                for s in range(SLO[k], SHI[k] - 1):
                    cuts[s] += 1
        else:  # a re-ranking of part [tr_a, tr_b): the same unplaced buffers as when it was made
            q = tr_c[tl]
            for p in range(slo_ptr[tr_a[tl]], slo_ptr[tr_b[tl]]):
                j = by_slo[p]
                if un[j]:
                    rank[j] = rlog[q]
                    q += 1
            st[_RT] = tr_c[tl]
    st[_TL] = tl


@numba.njit(cache=True)
def _check(x, y, cap, P, M, flags):
    """section_inference and unallocated_floor on sections ``[x, y)`` (the ones that changed). The
    lowest ``mo`` of a section's unplaced buffers is only needed when no witness (an unplaced member
    with ``mo + total <= cap``) is known: ``wit`` keeps the last one found per section (a hint,
    revalidated on use, never undone), so a section is rescanned only when its witness goes."""
    mem_ptr, mem_idx = P[10], P[11]
    mo, un, top, total, wit = M[0], M[1], M[3], M[4], M[8]
    ufloor = flags & UNALLOCATED_FLOOR
    inference = flags & SECTION_INFERENCE
    if not (ufloor or inference):
        return True
    for s in range(x, y):
        t = total[s] if inference else 0
        if top[s] + t > cap:
            return False
        if not ufloor or total[s] == 0:  # total == 0: no unplaced member
            continue
        w = wit[s]
        if un[w] and mo[w] + t <= cap:
            continue
        umin, w = _BIG, len(mo)
        for q in range(mem_ptr[s], mem_ptr[s + 1]):
            j = mem_idx[q]
            if un[j] and mo[j] < umin:
                umin, w = mo[j], j
        wit[s] = w
        if umin + t > cap:
            return False
    return True


@numba.njit(cache=True)
def _enclosing(a, b, P, M):
    """enclosing_first: the lowest label of an unplaced buffer of part ``[a, b)`` that can be placed
    at its ``mo`` without branching, or -1. The eligible buffers are tested in label order, so the
    neighbour scan stops at the first that passes."""
    ov_ptr, ov_idx, shift_ok, by_slo, slo_ptr = P[4], P[5], P[8], P[12], P[13]
    mo, un, out_left = M[0], M[1], M[2]
    cnt = 0
    for p in range(slo_ptr[a], slo_ptr[b]):
        k = by_slo[p]
        cnt += un[k] != 0 and out_left[k] == 0 and shift_ok[k] != 0
    if cnt == 0:
        return -1
    elig = np.empty(cnt, np.int64)
    i = 0
    for p in range(slo_ptr[a], slo_ptr[b]):
        k = by_slo[p]
        if un[k] and out_left[k] == 0 and shift_ok[k]:
            elig[i] = k
            i += 1
    elig.sort()
    for k in elig:
        ok = True
        for q in range(ov_ptr[k], ov_ptr[k + 1]):
            j = ov_idx[q]
            if un[j] and mo[j] < mo[k]:
                ok = False
                break
        if ok:
            return k
    return -1


@numba.njit(cache=True)
def _rerank(a, b, P, M, T, G, st):
    """dynamic_preorder: rank the unplaced buffers of part ``[a, b)`` by the preorder with ``T`` from
    the current section totals (MiniMalloc's SubSolve); returns the part's signature."""
    SLO, SHI, by_slo, slo_ptr, KW, KA, KZ, pcodes = P[2], P[3], P[12], P[13], P[14], P[15], P[16], P[17]
    un, total, rank = M[1], M[4], M[7]
    tr_k, tr_a, tr_b, tr_c = T[0], T[1], T[2], T[3]
    rlog = G[2]
    cnt = 0
    for p in range(slo_ptr[a], slo_ptr[b]):
        cnt += un[by_slo[p]] != 0
    labels = np.empty(cnt, np.int64)
    sig = _mix(np.uint64(a) * _K3 + np.uint64(b))
    rt, i = st[_RT], 0
    for p in range(slo_ptr[a], slo_ptr[b]):
        k = by_slo[p]
        if un[k]:
            labels[i] = k
            rlog[rt + i] = rank[k]
            sig = _mix(sig ^ np.uint64(k))
            i += 1
    tl = st[_TL]
    tr_k[tl], tr_a[tl], tr_b[tl], tr_c[tl] = -1, a, b, rt
    st[_TL], st[_RT] = tl + 1, rt + cnt
    order = np.argsort(labels, kind="mergesort")
    key = np.empty(cnt, np.int64)
    for c in range(len(pcodes) - 1, -1, -1):  # least significant key first, stable
        for i in range(cnt):
            k = labels[order[i]]
            if pcodes[c] == KEY_W:
                key[i] = -KW[k]
            elif pcodes[c] == KEY_A:
                key[i] = -KA[k]
            elif pcodes[c] == KEY_Z:
                key[i] = -KZ[k]
            else:
                t = 0
                for s in range(SLO[k], SHI[k]):
                    t = max(t, total[s])
                key[i] = -t
        order = order[np.argsort(key, kind="mergesort")]
    for i in range(cnt):
        rank[labels[order[i]]] = i
    return sig


@numba.njit(cache=True)
def run(P, M, T, G, C, st, cap, limit, flags):
    """Run the search from the state in ``st`` until it ends, reaches ``limit`` nodes, or a pool is
    full (see the module docstring)."""
    Z, SLO, SHI, ov_ptr, ov_idx, twin, by_slo, slo_ptr = P[0], P[2], P[3], P[4], P[5], P[9], P[12], P[13]
    mo, un, total, cuts, rank = M[0], M[1], M[4], M[5], M[7]
    f_type, f_a, f_b, f_lo, f_lk = T[7], T[8], T[9], T[10], T[11]
    f_c0, f_c1, f_ci, f_mark, f_cur = T[12], T[13], T[14], T[15], T[16]
    f_h1, f_h2, f_sig, piece_x, piece_y = T[17], T[18], T[19], T[20], T[21]
    cand_k, cand_o, rlog = G[0], G[1], G[2]  # cand_o: the key mo * (n + 1) + rank
    c_h1, c_h2, c_o, c_k = C
    mask = len(c_h1) - 1
    n = len(Z)
    canonical = flags & CANONICAL != 0
    hatless = flags & HATLESS != 0
    nogood = flags & NOGOOD_CACHE != 0
    filter_mono = canonical and flags & MONOTONIC_FLOOR != 0 and flags & SECTION_INFERENCE != 0
    action = st[_ACT]
    while True:
        if action == _ENTER:
            if st[_NODES] >= limit or st[_CT] + n + 1 > len(cand_k) or st[_RT] + n + 1 > len(rlog):
                st[_ACT] = action
                return LIMIT if st[_NODES] >= limit else GROW
            a, b, sub, lo, lk, sig = st[_PA], st[_PB], st[_PSUB], st[_PLO], st[_PLK], np.uint64(st[_PSIG])
            if sub == 2 and flags & DYNAMIC_PREORDER:
                sig = _rerank(a, b, P, M, T, G, st)
            d = st[_DEPTH]
            if sub >= 1 and flags & ENCLOSING_FIRST:
                k = _enclosing(a, b, P, M)
                if k >= 0:
                    st[_NODES] += 1
                    ct = st[_CT]
                    cand_k[ct], cand_o[ct] = k, mo[k] * (n + 1)
                    f_type[d], f_a[d], f_b[d], f_lo[d], f_lk[d] = _FORCED, a, b, 0, -1
                    f_c0[d], f_c1[d], f_ci[d], f_mark[d], f_cur[d] = ct, ct + 1, ct, st[_TL], -1
                    f_sig[d] = np.int64(sig)
                    st[_CT], st[_DEPTH] = ct + 1, d + 1
                    action = _NEXT
                    continue
            st[_NODES] += 1
            max_total = 0
            if filter_mono:
                for s in range(a, b):
                    max_total = max(max_total, total[s])
            # one pass over the part: the nogood key, min_top, and the candidates by every filter
            # but dominance (which needs min_top: applied after sorting by mo)
            cnt, min_top = 0, _BIG
            h1, h2 = _mix(sig ^ np.uint64(a)), _mix(sig + np.uint64(b) * _K3)
            c0 = ct = st[_CT]
            for p in range(slo_ptr[a], slo_ptr[b]):
                k = by_slo[p]
                if not un[k]:
                    continue
                m, r = mo[k], rank[k]
                cnt += 1
                min_top = min(min_top, m + Z[k])
                if nogood:  # additive over the set: no serial dependency between buffers
                    h1 += _mix((np.uint64(k) << np.uint64(40)) ^ np.uint64(m))
                    h2 += _mix(np.uint64(m) * _K1 + np.uint64(k) * _K3)
                if canonical and (m < lo or (m == lo and r <= lk)):
                    continue
                if filter_mono and m > cap - max_total:
                    continue
                if flags & IDENTICAL_ORDER and twin[k] < n and un[twin[k]]:
                    continue
                cand_k[ct], cand_o[ct] = k, m * (n + 1) + r  # sort key (mo, rank)
                ct += 1
            if cnt == 0:
                st[_RETV] = 1
                action = _RET
                continue
            h1, h2 = _mix(h1), _mix(h2) | np.uint64(1)
            if nogood:
                hit = False
                for q in range(4):
                    slot = (h1 + np.uint64(q)) & np.uint64(mask)
                    if c_h1[slot] == h1 and c_h2[slot] == h2:
                        hit = lo > c_o[slot] or (lo == c_o[slot] and lk >= c_k[slot])
                        break
                if hit:
                    st[_RETV] = 0
                    action = _RET
                    continue
            if flags & DOMINANCE:  # compact before sorting
                c1 = c0
                for i in range(c0, ct):
                    if mo[cand_k[i]] < min_top:
                        cand_k[c1], cand_o[c1] = cand_k[i], cand_o[i]
                        c1 += 1
                ct = c1
            f_type[d], f_a[d], f_b[d], f_lo[d], f_lk[d] = _SEARCH, a, b, lo, lk
            f_c0[d], f_c1[d], f_ci[d], f_mark[d], f_cur[d] = c0, ct, c0, st[_TL], -1
            f_h1[d], f_h2[d], f_sig[d] = np.int64(h1), np.int64(h2), np.int64(sig)
            st[_CT], st[_DEPTH] = ct, d + 1
            action = _NEXT
        elif action == _NEXT:
            f = st[_DEPTH] - 1
            forced = f_type[f] == _FORCED
            failed = False
            k = f_cur[f]
            if k >= 0:
                _undo_to(f_mark[f], P, M, T, G, st, flags)
                f_cur[f] = -1
                failed = hatless and not forced and not _has_unplaced(k, ov_ptr, ov_idx, un)
            while not failed:
                if f_ci[f] == f_c1[f]:
                    failed = True
                    break
                i = f_ci[f]
                f_ci[f] = i + 1
                # lazy selection by the key (mo, rank): most nodes try only their first candidate
                best = i
                for q in range(i + 1, f_c1[f]):
                    if cand_o[q] < cand_o[best]:
                        best = q
                cand_k[i], cand_k[best] = cand_k[best], cand_k[i]
                cand_o[i], cand_o[best] = cand_o[best], cand_o[i]
                k, o = cand_k[i], cand_o[i] // (n + 1)
                if o + Z[k] <= cap:
                    x, y = _place(k, o, P, M, T, st, flags)
                    if _check(x, y, cap, P, M, flags):
                        break
                    _undo_to(f_mark[f], P, M, T, G, st, flags)
                failed = hatless and not forced and not _has_unplaced(k, ov_ptr, ov_idx, un)
            if failed:
                if nogood and not forced:
                    _store(np.uint64(f_h1[f]), np.uint64(f_h2[f]), f_lo[f], f_lk[f], C, mask)
                st[_CT], st[_DEPTH], st[_RETV] = f_c0[f], f, 0
                action = _RET
                continue
            # descend: split into independent parts, or go on in this one
            f_cur[f] = k
            a, b = f_a[f], f_b[f]
            action = _ENTER
            if flags & DECOMPOSITION and SHI[k] - SLO[k] >= 2:
                pt = p0 = st[_PT]
                prev = a
                for s in range(SLO[k], SHI[k] - 1):
                    if cuts[s] == 0:
                        piece_x[pt], piece_y[pt] = prev, s + 1
                        prev = s + 1
                        pt += 1
                if pt > p0:
                    piece_x[pt], piece_y[pt] = prev, b
                    pt += 1
                    d = f + 1
                    f_type[d], f_a[d], f_b[d], f_sig[d] = _SPLIT, a, b, f_sig[f]
                    f_c0[d], f_c1[d], f_ci[d] = p0, pt, p0
                    st[_PT], st[_DEPTH] = pt, d + 1
                    action = _PIECE
                    continue
            st[_PA], st[_PB], st[_PSIG] = a, b, f_sig[f]
            if forced:
                st[_PSUB], st[_PLO], st[_PLK] = 1, 0, -1
            else:
                st[_PSUB], st[_PLO], st[_PLK] = 0, o, rank[k]
        elif action == _PIECE:
            f = st[_DEPTH] - 1
            action = _RET
            while f_ci[f] < f_c1[f]:
                i = f_ci[f]
                f_ci[f] = i + 1
                x, y = piece_x[i], piece_y[i]
                for p in range(slo_ptr[x], slo_ptr[y]):
                    if un[by_slo[p]]:
                        action = _ENTER
                        break
                if action == _ENTER:
                    st[_PA], st[_PB], st[_PLO], st[_PLK], st[_PSIG] = x, y, 0, -1, f_sig[f]
                    st[_PSUB] = 2 if flags & DYNAMIC_PREORDER else 1
                    break
            if action == _RET:
                st[_PT], st[_DEPTH], st[_RETV] = f_c0[f], f, 1
        else:  # _RET: hand the answer to the frame below
            f = st[_DEPTH] - 1
            if f < 0:
                st[_ACT] = action
                return FOUND if st[_RETV] else INFEASIBLE
            if f_type[f] == _SPLIT:
                if st[_RETV]:
                    action = _PIECE
                else:
                    st[_PT], st[_DEPTH] = f_c0[f], f
            elif st[_RETV]:
                st[_CT], st[_DEPTH] = f_c0[f], f  # keep its placements: the part is solved
            else:
                action = _NEXT


@numba.njit(cache=True)
def _has_unplaced(k, ov_ptr, ov_idx, un):
    for q in range(ov_ptr[k], ov_ptr[k + 1]):
        if un[ov_idx[q]]:
            return True
    return False


@numba.njit(cache=True)
def _store(h1, h2, lo, lk, C, mask):
    """Remember a failed node with its last placement ``(lo, lk)`` (the lowest one seen)."""
    c_h1, c_h2, c_o, c_k = C
    first = h1 & np.uint64(mask)
    for q in range(4):
        slot = (h1 + np.uint64(q)) & np.uint64(mask)
        if c_h1[slot] == h1 and c_h2[slot] == h2:
            if lo < c_o[slot] or (lo == c_o[slot] and lk < c_k[slot]):
                c_o[slot], c_k[slot] = lo, lk
            return
        if c_h2[slot] == 0:
            first = slot
            break
    c_h1[first], c_h2[first], c_o[first], c_k[first] = h1, h2, lo, lk

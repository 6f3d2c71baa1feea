"""CuPy launchers of the fused protected attention core (``kernels/fused.cu``): the entry points of
:mod:`attention.fused` for CuPy arrays, same signatures, algorithm, checks and thresholds
(:mod:`attention.fused_rules`).

The kernels judge every tile and recompute flagged tiles and blocks themselves (the decision is
block-uniform); each call reads the per-task records back once and books them into
``ctx.report``. The backward runs FlashAttention-2's two sweeps as two kernels (dK and dV per key
block, dQ per query block: no atomics), each recomputing the tiles it needs. Tiles are
:data:`BR` x :data:`BC` = 32 x 32 (``FBR``/``FBC`` of the kernel source), head dimensions up to
:data:`MAX_HEAD_DIM`; float16, bfloat16 (``ml_dtypes``), float32 and float64 data, tile
arithmetic in float32 (float64 for float64), the 16-bit tile products S and dP on tensor cores
where CUDA's headers allow (``FUSED_WMMA`` in the source).

Attention dropout as the CPU core's: the kernels regenerate the keep decisions of
:mod:`attention.dropout_hash` per tile, bit for bit, from ``(seed, head, query, key)``; the same
checks and carried checksums cover the dropped tile (:mod:`attention.fused`).

Faults are injected by the kernels, at the element a :class:`DeviceFault` names (``ctx.fault_hook``
must be one, or None): a Python hook cannot see the tiles of a kernel. :func:`device_fault` turns
a toolkit :class:`abftgemm.faults.Fault` into one (the campaign's ``--core fused`` on CuPy). A
toolkit Fault that names only sites outside the kernels (the final checks' ``fused:out``,
``fused:dV_out``, ``fused:dK_out`` of :mod:`attention.fused_final`, which the forward's carried
output checksums, ``saved["sums"]``, make possible on CuPy too) is taken as well: the kernels
inject nothing, and it corrupts the returned arrays where the final checks call it.

Imports CuPy at the top: import it only once CuPy arrays are in play.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import cupy
import numpy

from abftgemm.backend import to_host
from abftgemm.cuda_kernels import INT32_MAX, cdiv, typed_kernel
from abftgemm.faults import Fault, near_inf_value
from attention import _cpu_fused as K
from attention import kernels
from attention.context import Context
from attention.fused_deferred import Deferred
from attention.fused_rules import (BACKWARD_SITES, BAD_ADDITIVE, FORWARD_SITES, additive_bad,
                                   additive_of, book, book_findings, check_gradient,
                                   check_inputs, coefficients, count_checked, dropout_of,
                                   dscores_tolerance, kernel_dropout, key_additive_bad,
                                   key_additive_of, key_visible_of, probs_tolerance, trusted)

BR = 32  # query rows per block (FBR in fused.cu)
BC = 32  # keys per tile (FBC)
MAX_HEAD_DIM = 128  # FDMAX
_THREADS = 128  # FNT
_ENCODE_BLOCK = 256
_KINDS = {"inf": (1, math.inf), "-inf": (1, -math.inf), "nan": (1, math.nan), "near-inf": (2, None),
          "additive": (3, None), "scale": (4, None), "bitflip": (5, None)}
#: Sites whose element is one of an accumulator (hit after a tile ``step`` of its sweep).
_ACCUMULATORS = ("fused:O_acc", "fused:rowsum", "fused:dQ_acc", "fused:dK_acc", "fused:dV_acc")
#: Bit patterns of an all-ones exponent (INF or NaN), by item size and dtype name.
_EXPONENT = {"float16": 0x7C00, "bfloat16": 0x7F80, "float32": 0x7F800000,
             "float64": 0x7FF0000000000000}
_UINT = {2: numpy.uint16, 4: numpy.uint32, 8: numpy.uint64}


@dataclass
class DeviceFault:
    """A fault the fused CUDA kernels inject into one element of an internal site.

    Parameters
    ----------
    site : str
        One of :data:`attention._cpu_fused.HOOK_SITES`: the checked sites, and
        ``fused:dropout``, the dropped probabilities (forward and the dK/dV kernel's backward;
        covered by ``fused:O_acc`` and ``fused:dV_acc``).
    row, col : int
        The element, in the site's matrix of head ``head``: ``fused:S``, ``fused:P``,
        ``fused:dropout``, ``fused:dP``, ``fused:dS``: query x key; ``fused:O_acc``,
        ``fused:dQ_acc``: query x head dim; ``fused:dK_acc``, ``fused:dV_acc``: key x head dim;
        ``fused:rowsum``: the query (``col`` 0). ``fused:S``, ``fused:P`` and ``fused:dropout``
        are hit in the forward (the backward only sees a fault of theirs that the forward did not
        take).
    head : int
        Index into the leading (batch * heads) axis.
    step : int
        Accumulator sites: the tile of the sweep after which the accumulator is hit (0: the
        first); 0 for tile sites.
    kind : str
        ``"inf"``, ``"-inf"``, ``"nan"``, ``"near-inf"`` (the magnitude of
        :func:`abftgemm.faults.near_inf_value` of the tile arithmetic's dtype, the element's
        sign), ``"additive"`` (adds ``value``), ``"scale"`` (multiplies by ``value``) or
        ``"bitflip"`` (flips bit ``bit`` of the element as the tile holds it: float32 for
        16-bit and float32 data, float64 for float64).
    value : float
        Magnitude of ``"additive"``, factor of ``"scale"``.
    bit : int, optional
        ``"bitflip"``: the bit (0 is the least significant mantissa bit, as
        :func:`abftgemm.faults.bit_name` numbers them); required for that kind only.
    persistent : bool
        Also corrupt every recomputation (default: the first computation only, in the first call
        that has the site).

    After a call, ``hits`` counts the injections so far and ``old`` holds the last value replaced.
    """

    site: str
    row: int
    col: int = 0
    head: int = 0
    step: int = 0
    kind: str = "inf"
    value: float = 0.0
    bit: int | None = None
    persistent: bool = False
    hits: int = 0
    old: float = math.nan

    def __post_init__(self) -> None:
        if self.site not in K.HOOK_SITES:
            raise ValueError(f"site must be one of {K.HOOK_SITES}, got {self.site!r}")
        if self.kind not in _KINDS:
            raise ValueError(f"kind must be one of {tuple(_KINDS)}, got {self.kind!r}")
        if min(self.row, self.col, self.head, self.step) < 0:
            raise ValueError("row, col, head and step must be >= 0")
        if (self.bit is None) == (self.kind == "bitflip"):
            raise ValueError("'bit' is required for kind 'bitflip' and applies to it alone")

    def __call__(self, site: str, c: Any) -> None:
        """As a layer's fault hook, at the sites outside the kernels (the projections'): nothing;
        the kernels inject this fault themselves."""

    def descriptor(self, sites: tuple[str, ...], arith: numpy.dtype) -> cupy.ndarray | None:
        """The kernel's descriptor (``F_*`` of fused.cu) when this call should inject, else None."""
        if self.site not in sites or (self.hits and not self.persistent):
            return None
        code, value = _KINDS[self.kind]
        if code == 5:
            if not 0 <= self.bit < 8 * arith.itemsize:
                raise ValueError(f"bit {self.bit} is outside [0, {8 * arith.itemsize}) of the "
                                 f"tile arithmetic's {arith.name}")
            value = self.bit
        elif value is None:
            value = near_inf_value(arith) if code == 2 else self.value
        return cupy.asarray(numpy.array(
            [K.HOOK_SITES.index(self.site), self.head, self.row, self.col, self.step, code,
             float(self.persistent), value, 0.0, math.nan]))

    def record(self, desc: cupy.ndarray | None) -> None:
        """Take the hit count and the old value back from a descriptor after its launch."""
        if desc is None:
            return
        got = desc.get()
        self.hits += int(got[8])
        if got[8]:
            self.old = float(got[9])


def device_fault(fault: Fault, q_shape: tuple[int, int, int], seq_k: int, dtype: Any, *,
                 causal: bool = False, step: int | None = None) -> DeviceFault:
    """The :class:`DeviceFault` of a toolkit :class:`abftgemm.faults.Fault`: the element it names
    in one fused site's matrix of one head, what it does to it.

    The kernels inject one element per fault, so ``fault`` must name one site of
    :data:`attention._cpu_fused.HOOK_SITES` (``sites``), have pattern ``"element"``, a kind other
    than ``"multibit"``, ``times`` 1 (the first computation) or None (persistent), and ``skip`` 0
    (it counts the CPU hook's tile calls; a CUDA accumulator's tile is ``step``). Its ``batch`` (the
    head), ``row`` and ``col`` index the site's whole matrix of one head (as :class:`DeviceFault`
    says, not one tile); what it leaves None is drawn from its seed, among the elements the kernels
    compute: with ``causal``, a tile-site element at or below the diagonal's tile, and an
    accumulator's ``step`` among the tiles its block sweeps. A ``"bitflip"`` without ``bit`` draws
    one of the tile arithmetic's bits (float32 below float64).

    Parameters
    ----------
    fault : Fault
    q_shape : tuple of int
        ``(n, seq_q, d)`` of the call's queries (``n`` = batch * heads).
    seq_k : int
        Keys per head.
    dtype : dtype
        The data's dtype.
    causal : bool
    step : int, optional
        Accumulator sites: the tile after which it is hit (drawn when None); tile sites take none.

    Raises
    ------
    ValueError
        On a fault the kernels cannot inject, named.
    IndexError
        On a position or step outside the site's matrix or sweep.
    """
    sites = tuple(fault.sites or ())
    if len(sites) != 1 or sites[0] not in K.HOOK_SITES:
        raise ValueError(f"the fault must name one site of {K.HOOK_SITES}, got {fault.sites}")
    site = sites[0]
    if fault.pattern != "element":
        raise ValueError(f"the fused CUDA kernels inject one element per fault; pattern "
                         f"{fault.pattern!r} is not 'element'")
    if fault.kind == "multibit":
        raise ValueError("the fused CUDA kernels flip one bit per fault ('bitflip'), not several")
    if fault.times not in (1, None):
        raise ValueError(f"times must be 1 (the first computation) or None (persistent), got "
                         f"{fault.times}")
    if fault.skip:
        raise ValueError("skip counts the CPU hook's tile calls; name a CUDA accumulator's tile "
                         "with step")
    n, lq, d = q_shape
    arith = _arith(numpy.dtype(dtype))
    rng = numpy.random.default_rng(fault.seed)
    head = fault.batch[0] if isinstance(fault.batch, tuple) and len(fault.batch) == 1 \
        else fault.batch
    head = _position(rng, head, n, "batch (head)")
    if site in ("fused:dK_acc", "fused:dV_acc"):
        rows, cols = seq_k, d
    else:
        rows, cols = lq, (1 if site == "fused:rowsum" else d if site in _ACCUMULATORS else seq_k)
    row = _position(rng, fault.row, rows, "row")
    reach = cols
    if causal and site not in _ACCUMULATORS:  # the tiles at or below the diagonal's
        reach = min(cols, (row // BR + 1) * BR)
    col = _position(rng, fault.col, reach, "col")
    if site in _ACCUMULATORS:
        steps = _sweep(site, row, lq, seq_k, causal)
        step = _position(rng, step, steps, "step")
    elif step:
        raise ValueError(f"{site} is a tile site: it takes no step")
    extra: dict[str, Any] = {}
    if fault.kind == "bitflip":
        extra["bit"] = fault.bit if fault.bit is not None else int(
            rng.integers(8 * arith.itemsize))
    elif fault.kind in ("additive", "scale"):
        extra["value"] = fault.magnitude if fault.kind == "additive" else fault.factor
    return DeviceFault(site, row, col, head=head, step=step or 0, kind=fault.kind,
                       persistent=fault.times is None, **extra)


def _position(rng: numpy.random.Generator, given: int | None, size: int, what: str) -> int:
    """``given``, checked against ``size``, or one drawn from ``rng``."""
    if given is None:
        if size < 1:
            raise IndexError(f"no {what} to draw from: the sweep or matrix is empty")
        return int(rng.integers(size))
    if not 0 <= given < size:
        raise IndexError(f"{what} {given} is out of range for size {size}")
    return int(given)


def _sweep(site: str, row: int, lq: int, lk: int, causal: bool) -> int:
    """Tiles the kernels accumulate accumulator ``site``'s row ``row`` over (its steps)."""
    if site in ("fused:dK_acc", "fused:dV_acc"):  # key row: the query blocks from its own
        first = (row // BC) * BC if causal else 0
        return cdiv(max(lq - first, 0), BR)
    end = min(lk, (row // BR + 1) * BR) if causal else lk
    return cdiv(end, BC)


def fused_forward(q: Any, k: Any, v: Any, ctx: Context, *, scale: float | None = None,
                  causal: bool = False, key_visible: Any | None = None,
                  attn_mask: Any | None = None, dropout: float = 0.0,
                  dropout_seed: int | None = None, defer: Deferred | None = None,
                  key_add: Any | None = None, check_finite: bool = True
                  ) -> tuple[cupy.ndarray, dict[str, Any]]:
    """:func:`attention.fused.fused_forward` for CuPy arrays (float16, bfloat16, float32 or
    float64, head dim at most :data:`MAX_HEAD_DIM`); ``saved["lse"]`` and ``saved["lse_lo"]`` are
    float32 below float64, ``saved["sums"]`` the output rows' carried checksums and kept sums
    ``(n, seq_q, 4)`` (float64, as the CPU kernel's; None with ``check="off"``) for
    :mod:`attention.fused_final`.
    Dropout's keep decisions are the CPU core's for the same seed; ``ks = 1 / (1 - p)`` is
    rounded to the tile arithmetic's dtype. With ``defer`` (an attention pass's), the
    finiteness of the inputs and the kernel's records are judged at the pass's settle
    (:mod:`attention.fused_deferred`), not read here; so are the masks' values. With
    ``check_finite`` False, that of the inputs is not judged at all (its caller did)."""
    fault = _fault(ctx)
    scale, visible = _validate(q, k, v, scale, causal, key_visible,
                               defer is None and check_finite)
    drop = dropout_of(dropout, dropout_seed)
    add = None if attn_mask is None else additive_of(cupy, attn_mask, q, k, defer is None)
    if defer is not None and add is not None:
        defer.add(additive_bad(cupy, add, q.dtype), _refuse_mask)
    keys, key_heads = (None, 1) if key_add is None else \
        key_additive_of(cupy, key_add, q, k, add, defer is None)
    if defer is not None and keys is not None:
        defer.add(key_additive_bad(cupy, keys, add, q.dtype), _refuse_mask)
    n, lq, d = q.shape
    lk = k.shape[1]
    arith = _arith(q.dtype)
    check, correct = ctx.check != "off", ctx.check == "correct"
    tiles = cdiv(lk, BC)
    nqb = cdiv(lq, BR)
    if n * nqb > INT32_MAX:
        raise ValueError(f"too many query blocks for one grid: {n} x {nqb}")
    params = cupy.asarray(numpy.concatenate([
        coefficients(d, BR, arith, block=d), coefficients(lk, d, arith, 2 * tiles),
        coefficients(lk, 1, arith, 2 * tiles), probs_tolerance(arith)]))
    ve = _row_encodings(v) if check else None
    out = cupy.empty(q.shape, q.dtype)
    # 16-bit data: the output in float32 for the kernel's check, before it is rounded
    ws_o = cupy.empty(q.shape, arith) if check and arith != q.dtype else None
    lse, lse_lo = cupy.empty((n, lq), arith), cupy.empty((n, lq), arith)
    sums = cupy.empty((n, lq, 4)) if check else None
    rec = cupy.zeros((n * nqb, len(K.SITES), K.FIELDS))
    status = cupy.zeros(n * nqb, numpy.int32)
    desc = None if fault is None else fault.descriptor(_with_dropout(FORWARD_SITES, drop), arith)
    per_head = _per_head(add, n)
    with q.device:
        _kernel(q.device.id, kernels.FUSED_FORWARD, q.dtype.name)(
            (n * nqb,), (_THREADS,),
            (q, k, v, ve, visible, per_head, _stride(per_head), keys, numpy.int32(key_heads),
             numpy.int32(lq), numpy.int32(lk),
             numpy.int32(d), numpy.float64(scale), numpy.int32(causal), numpy.int32(check),
             numpy.int32(correct), *_dropout_args(drop, arith), params, desc, ws_o, out, lse,
             lse_lo, sums, rec, status))
    if fault is not None:
        fault.record(desc)
    if defer is not None and check_finite:
        # non-finite inputs: the replay raises, or takes them repaired
        defer.add(_nonfinite(q) | _nonfinite(k) | _nonfinite(v), lambda c: True)
    _book(ctx, rec, status, lambda t: t // nqb, FORWARD_SITES, check, defer)
    return out, {"q": q, "k": k, "v": v, "out": out, "lse": lse, "lse_lo": lse_lo,
                 "scale": scale, "causal": causal, "visible": visible, "add": add,
                 "keys": keys, "key_heads": key_heads, "dropout": drop, "sums": sums}


def fused_backward(saved: dict[str, Any], d_out: Any, ctx: Context,
                   defer: Deferred | None = None, check_finite: bool = True
                   ) -> tuple[cupy.ndarray, cupy.ndarray, cupy.ndarray]:
    """:func:`attention.fused.fused_backward` for CuPy arrays: ``(dq, dk, dv)`` from the
    gradient ``d_out`` of :func:`fused_forward`'s output (C-contiguous, its dtype, finite).
    ``defer`` and ``check_finite`` as :func:`fused_forward`'s (a non-finite ``d_out`` replays
    the pass)."""
    fault = _fault(ctx)
    q, k, v, out, lse, lse_lo = (saved[key] for key in ("q", "k", "v", "out", "lse", "lse_lo"))
    check_gradient(cupy, d_out, q, finite if defer is None and check_finite else trusted)
    n, lq, d = q.shape
    lk = k.shape[1]
    arith = _arith(q.dtype)
    check, correct = ctx.check != "off", ctx.check == "correct"
    nqb, nkb = cdiv(lq, BR), cdiv(lk, BC)
    params = cupy.asarray(numpy.concatenate([
        coefficients(d, BC, arith, block=d), numpy.zeros(10), probs_tolerance(arith),
        dscores_tolerance(arith, BC), coefficients(lq, d, arith, nqb),
        coefficients(lk, d, arith, nkb)]))
    dd = cupy.empty((n, lq), arith)
    with q.device:
        _kernel(q.device.id, kernels.FUSED_DELTA, q.dtype.name)(
            (min(cdiv(n * lq, _ENCODE_BLOCK), 65535),), (_ENCODE_BLOCK,),
            (d_out, out, numpy.int64(n * lq), numpy.int32(d), dd))
    qe, ke, doe = (_row_encodings(x) if check else None for x in (q, k, d_out))
    ws_q = cupy.empty(q.shape, arith) if check else None
    ws_k, ws_v = (cupy.empty(k.shape, arith) if check else None for _ in range(2))
    dq, dk, dv = (cupy.empty(x.shape, x.dtype) for x in (q, k, v))
    kv_sums = cupy.empty((n, lk, 6)) if check else None
    rec = cupy.zeros((n * (nkb + nqb), len(K.SITES), K.FIELDS))
    status = cupy.zeros(n * (nkb + nqb), numpy.int32)
    split = n * nkb
    # Tile sites are injected by the dK/dV kernel, dQ_acc by the dQ kernel.
    drop = saved.get("dropout")
    desc_kv = desc_q = None
    if fault is not None:
        kv_sites = tuple(s for s in BACKWARD_SITES if s != "fused:dQ_acc")
        desc_kv = fault.descriptor(_with_dropout(kv_sites, drop), arith)
        desc_q = fault.descriptor(("fused:dQ_acc",), arith)
    per_head = _per_head(saved["add"], n)
    mask = (per_head, _stride(per_head), saved["keys"], numpy.int32(saved["key_heads"]))
    common = (numpy.int32(lq), numpy.int32(lk), numpy.int32(d), numpy.float64(saved["scale"]),
              numpy.int32(saved["causal"]), numpy.int32(check), numpy.int32(correct),
              *_dropout_args(drop, arith), params)
    with q.device:
        _kernel(q.device.id, kernels.FUSED_BACKWARD_KV, q.dtype.name)(
            (split,), (_THREADS,),
            (q, k, v, d_out, lse, lse_lo, dd, qe, doe, saved["visible"], *mask, *common,
             desc_kv, ws_k, ws_v, dk, dv, kv_sums, rec[:split], status[:split]))
        _kernel(q.device.id, kernels.FUSED_BACKWARD_Q, q.dtype.name)(
            (n * nqb,), (_THREADS,),
            (q, k, v, d_out, lse, lse_lo, dd, ke, saved["visible"], *mask, *common, desc_q,
             ws_q, dq, rec[split:], status[split:]))
    if fault is not None:
        fault.record(desc_kv)
        fault.record(desc_q)
    if defer is not None and check_finite:
        defer.add(_nonfinite(d_out), lambda c: True)
    _book(ctx, rec, status, lambda t: t // nkb if t < split else (t - split) // nqb,
          BACKWARD_SITES, check, defer)
    saved["kv_sums"] = kv_sums
    return dq, dk, dv


def _book(ctx: Context, rec: cupy.ndarray, status: cupy.ndarray, batch_of: Any,
          sites: tuple[str, ...], check: bool, defer: Deferred | None) -> None:
    """The kernels' records into ``ctx.report`` (:func:`attention.fused_rules.book`): read now,
    or at the pass's settle (``defer``) when a task flagged or failed."""
    if not check:
        return
    if defer is None:
        book(ctx, to_host(rec), to_host(status), batch_of, sites, check)
        return
    count_checked(ctx, sites)
    flagged = (rec[:, :, K.FLAGS] != 0).any() | (status != 0).any()
    defer.add(flagged, lambda c: book_findings(c, to_host(rec), to_host(status), batch_of)
              or False)


def _fault(ctx: Context) -> DeviceFault | None:
    """The kernels' fault: ``ctx.fault_hook`` when it is a :class:`DeviceFault`; None for none,
    and for a toolkit :class:`abftgemm.faults.Fault` that names sites, none of them the kernels'
    (the final checks' sites, :mod:`attention.fused_final`, and the layer's own: it is called on
    the returned arrays there, as on NumPy)."""
    hook = ctx.fault_hook
    if hook is None or isinstance(hook, DeviceFault):
        return hook
    if isinstance(hook, Fault) and hook.sites is not None and not hook.sites & set(K.HOOK_SITES):
        return None
    raise TypeError("the fused CUDA core injects faults in its kernels: ctx.fault_hook must be an "
                    "attention._cuda_fused.DeviceFault, an abftgemm.faults.Fault that names none of"
                    f" the kernels' sites {K.HOOK_SITES}, or None, got {type(hook).__name__} "
                    "(attention._cuda_fused.device_fault converts a Fault for a kernel site)")


def _with_dropout(sites: tuple[str, ...], drop: tuple[float, int] | None) -> tuple[str, ...]:
    """``sites``, and the dropped tile's fault site when the call has dropout."""
    return sites if drop is None else sites + (K.HOOK_SITES[K.DROP_],)


def _dropout_args(drop: tuple[float, int] | None, arith: numpy.dtype
                  ) -> tuple[numpy.uint64, numpy.uint64, numpy.float64]:
    """The kernels' ``(seed, thr, ks)`` (:func:`attention.fused_rules.kernel_dropout`; ``thr`` 0: no
    dropout), ``ks`` rounded to the tile arithmetic's dtype and passed as float64 (exact)."""
    seed, thr, ks = kernel_dropout(drop, arith)
    return numpy.uint64(seed), numpy.uint64(thr), numpy.float64(ks)


def _arith(dtype: numpy.dtype) -> numpy.dtype:
    """The tile arithmetic's dtype: float64 for float64, float32 otherwise."""
    return numpy.dtype(numpy.float64 if dtype == numpy.float64 else numpy.float32)


def _validate(q: Any, k: Any, v: Any, scale: float | None, causal: bool,
              key_visible: Any | None, read_finite: bool = True
              ) -> tuple[float, cupy.ndarray | None]:
    """Check the inputs (as :func:`attention.fused._validate` does for NumPy; their finiteness
    only with ``read_finite``); ``(scale, key_visible as a C-contiguous (n, seq_k) bool device
    array or None)``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, cupy.ndarray):
            raise TypeError(f"{name} must be a CuPy array, got {type(t).__name__}")
        if t.dtype.name not in kernels.CUDA_TYPES or t.dtype != q.dtype:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, of q's dtype "
                            f"{q.dtype}; got {t.dtype}")
    scale = check_inputs(q, k, v, scale, causal, finite if read_finite else trusted)
    if q.shape[2] > MAX_HEAD_DIM:
        raise ValueError(f"the fused CUDA core takes head dims up to {MAX_HEAD_DIM}, got "
                         f"{q.shape[2]}")
    if max(q.shape[1], k.shape[1]) * q.shape[2] > INT32_MAX:
        raise ValueError("the fused CUDA core indexes one head in 32 bits")
    if key_visible is None:
        return scale, None
    return scale, key_visible_of(cupy, key_visible, q, k)


def _stride(add: cupy.ndarray | None) -> numpy.int64:
    """The kernels' head stride of the additive mask ``(1 or n, seq_q, seq_k)``: 0 when shared."""
    return numpy.int64(0 if add is None or add.shape[0] == 1 else add.shape[1] * add.shape[2])


def _per_head(add: cupy.ndarray | None, n: int) -> cupy.ndarray | None:
    """The additive mask ``(m, seq_q, seq_k)`` as the kernels take it, ``(1 or n, seq_q,
    seq_k)``: a mask per group of heads repeated per head (the CPU kernels read it per group; an
    index per group in the CUDA kernels made ptxas spill, bench/NOTES.md)."""
    if add is None or add.shape[0] in (1, n):
        return add
    return cupy.repeat(add, n // add.shape[0], axis=0)


def finite(x: cupy.ndarray) -> bool:
    """No INF or NaN in ``x``, from the exponent bits (bfloat16 has no CuPy arithmetic)."""
    return not bool(to_host(_nonfinite(x)))


def _nonfinite(x: cupy.ndarray) -> cupy.ndarray:
    """A 0-d bool device array: ``x`` holds INF or NaN (its exponent bits all set)."""
    bits = _EXPONENT[x.dtype.name]
    return ((x.view(_UINT[x.dtype.itemsize]) & bits) == bits).any()


def _refuse_mask(ctx: Context) -> bool:
    """A deferred call's mask failed :func:`attention.fused_rules.additive_ok`."""
    raise ValueError(BAD_ADDITIVE)


def _row_encodings(x: cupy.ndarray) -> cupy.ndarray:
    """``(n, L, 3)`` float64 row encodings of ``x`` over its last axis (plain, weighted by
    ``(c + 1) / d``, absolute), as :func:`attention._cpu_fused.encode_rows`."""
    n, length, d = x.shape
    out = cupy.empty((n, length, 3))
    rows = n * length
    with x.device:
        _kernel(x.device.id, kernels.FUSED_ENCODE, x.dtype.name)(
            (min(cdiv(rows, _ENCODE_BLOCK), 65535),), (_ENCODE_BLOCK,),
            (x, numpy.int64(rows), numpy.int32(d), out))
    return out


def _kernel(device_id: int, name: str, dtype: str) -> cupy.RawKernel:
    """Template ``name`` of fused.cu instantiated for NumPy dtype ``dtype`` on device
    ``device_id``."""
    return typed_kernel(kernels, kernels.FUSED_FILE, name, dtype, device_id)

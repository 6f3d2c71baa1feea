"""Detection power of the fused attention core (:mod:`attention.fused`), with expectations fixed
in this file as tests/test_detection_power.py fixes them for the GEMMs and the unfused softmax:
computed from first principles, never from :mod:`attention.fused_rules` (a test judged by the
threshold it tests loosens with it). Each is stated close enough to the current detection limit
that 2x looser product thresholds or a 10x looser softmax-backward tolerance fail here
(``make mutations``: scripts/mutation_check.py).

One head of 32 queries and 32 keys: one tile on either backend (128 x 128 tiles on the CPU,
32 x 32 in the CUDA kernels), whose checks then see the whole matrices.
"""
from __future__ import annotations

import numpy as np
import pytest

from abftgemm.faults import Fault
from attention.context import Context
from attention.fused import fused_backward, fused_forward
from conftest import BACKENDS

#: check="detect" warns on every fault it leaves in place: here that is the point.
pytestmark = pytest.mark.filterwarnings("ignore::abftgemm.report.FaultDetectedWarning")

#: Unit roundoffs, written out from the IEEE formats (not read from the library).
U = {"float32": 2.0 ** -24, "float64": 2.0 ** -53}
SEQ, D = 32, 64


def _fault(xp, site: str, row: int, col: int, magnitude: float, q_shape, dtype) -> object:
    """``magnitude`` added once to element ``(row, col)`` of ``site``'s matrix of head 0: the
    toolkit fault on the CPU, the kernels' own on CUDA."""
    fault = Fault("additive", "element", row=row, col=col, magnitude=magnitude, sites=site,
                  times=1)
    if xp is np:
        return fault
    from attention._cuda_fused import device_fault

    return device_fault(fault, q_shape, q_shape[1], dtype)


def _sites(xp, q, k, v, fault, do=None) -> tuple[set, set]:
    """The sites flagged in a forward (and backward, with ``do``) with ``fault`` at the phase it
    names, and those of the same calls without it."""
    flagged = []
    for hook in (fault, None):
        ctx = Context(check="detect", fault_hook=hook if do is None else None)
        out, saved = fused_forward(*(xp.asarray(t) for t in (q, k, v)), ctx, causal=do is not None)
        if do is not None:
            ctx = Context(check="detect", fault_hook=hook)
            fused_backward(saved, xp.asarray(do), ctx)
        flagged.append(set(ctx.report.sites))
    return flagged[0], flagged[1]


# ------------------------------------------------------------------ the scores' product

#: One score changed by more than GUARANTEE times the worst-case rounding bound of its column is
#: detected (the forward checks S by its column checksums). Integer operands make S exact. The
#: kernels' thresholds sit at 1.00 (float32) and 1.00-1.63 (float64: the CPU's sums allow for its
#: 128-row tiles) times the bound here (measured), so the guarantee leaves a margin of 1.4 and
#: 1.47; thresholds twice as loose (2.0 and 3.26 times) miss the change.
GUARANTEE = {"float32": 1.4, "float64": 2.4}


def column_bound(q64: np.ndarray, k64: np.ndarray, name: str) -> np.ndarray:
    """Worst-case rounding of the column checksum differences of a fault-free ``S = q k^T``
    (Higham, section 3.1, constant 1): ``d u sum_i |q_i| . |k_j|`` for the dot products
    accumulated in the data's precision, ``u |S_ij|`` for storing them, and ``(L + d) u_64``
    relative to both sums for the checks' float64 sums of ``L`` entries."""
    u, u64 = U[name], U["float64"]
    p = np.abs(q64) @ np.abs(k64).T
    s = np.abs(q64 @ k64.T)
    return D * u * p.sum(0) + u * s.sum(0) + (SEQ + D) * u64 * (p.sum(0) + s.sum(0))


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("name", ["float32", "float64"])
def test_score_change_above_the_column_bound_is_detected(xp, name):
    for seed in range(4):
        rng = np.random.default_rng(seed)
        q64, k64 = (rng.integers(-16, 17, (1, SEQ, D)).astype(np.float64) for _ in range(2))
        v = rng.standard_normal((1, SEQ, D)).astype(name)
        i, j = (int(x) for x in rng.integers(SEQ, size=2))
        change = (1 if seed % 2 else -1) * GUARANTEE[name] * column_bound(q64[0], k64[0], name)[j]
        q, k = q64.astype(name), k64.astype(name)
        fault = _fault(xp, "fused:S", i, j, change, q.shape, q.dtype)
        faulted, clean = _sites(xp, q, k, v, fault)
        assert faulted == {"fused:S"}, (seed, i, j, change)
        assert not clean


# ------------------------------------------------------------------ the softmax backward

#: Causal row 0 sees key 0 alone: P_00 = 1, and dS_00 = P_00 (dP_00 - D_0) = 0 exactly, with
#: D_0 = dO_0 . O_0 = dO_0 . v_0 = dP_00. Its two invariants compare the row sum of dS with
#: r1 - D r2 and the dP-weighted sum with v - D r1 (r1 = sum_j P dP, r2 = sum_j P, v = sum_j P
#: dP^2), whose magnitudes are 2 |dP_00| and 2 dP_00^2: in float32, rounding to the data's dtype
#: makes each of those sums off by a few u times its magnitude. A change of dS_00 larger than
#: SOFTMAX_BACKWARD u |dP_00| is detected: the check allows 8 (3x margin); 10x looser it would
#: allow 80 (3.3x margin the other way).
SOFTMAX_BACKWARD = 24


@pytest.mark.parametrize("xp", BACKENDS)
def test_dscores_change_above_the_row_bound_is_detected(xp):
    name = "float32"
    for seed in range(4):
        rng = np.random.default_rng(seed)
        q, k, v, do = (rng.standard_normal((1, SEQ, D)).astype(name) for _ in range(4))
        dp00 = float(np.dot(do[0, 0].astype(np.float64), v[0, 0].astype(np.float64)))
        change = SOFTMAX_BACKWARD * U[name] * abs(dp00)
        fault = _fault(xp, "fused:dS", 0, 0, change, q.shape, q.dtype)
        faulted, clean = _sites(xp, q, k, v, fault, do)
        assert faulted == {"fused:dS"}, (seed, dp00)
        assert not clean


def test_the_faults_change_what_they_name():
    """The set-up itself, on the CPU (the hook sees the tiles): each change lands whole."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.integers(-16, 17, (1, SEQ, D)).astype(np.float32) for _ in range(3))
    fault = _fault(np, "fused:S", 3, 5, 7.0, q.shape, q.dtype)
    fused_forward(q, k, v, Context(check="detect", fault_hook=fault))
    (inj,) = fault.injected
    assert inj.new[0] - inj.old[0] == 7.0

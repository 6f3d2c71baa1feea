"""scripts/fused_clean_calls.py, the fused core's false-positive campaign, in small: its
adversarial clean calls (logits near overflow and far beyond, flat rows, key padding, a head that
sees no key, additive masks with "not allowed" entries, dropout) flag nothing on either backend
(the numba kernels; the CUDA kernels on a GPU or on ``cupy-on-cpu``), return values within the
rounding bound of the float64 reference (and the comparison does fail on a corrupted value), and
it reports what it ran. A GPU session runs it at length with ``--backend cupy``."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import BACKENDS

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fused_clean_calls.py"


def _load(monkeypatch):
    spec = importlib.util.spec_from_file_location("fused_clean_calls", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look themselves up
    spec.loader.exec_module(module)
    return module


def _main(argv: list[str], monkeypatch) -> int:
    return _load(monkeypatch).main(argv)


@pytest.mark.parametrize("xp", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_the_clean_call_campaign_flags_nothing(xp, dtype, capsys, monkeypatch):
    backend = "numpy" if xp is np else "cupy"
    status = _main(["--calls", "16", "--max-len", "40", "--long-calls", "1", "--long-len", "70",
                    "--dtype", dtype, "--backend", backend, "--seed", "3"], monkeypatch)
    out = capsys.readouterr().out
    assert f"backend {backend}, dtype {dtype}" in out
    assert "random lengths (L 1..40): 16 clean fwd+bwd calls" in out, out
    assert "additive-mask 2, dropout 2, far-beyond 2, flat-rows 2" in out, out
    assert "long (L 70): 1 clean fwd+bwd calls" in out, out
    assert out.count("0 flagged (false positives), 0 raised, 0 with INF/NaN, "
                     "0 with wrong values") == 2, out
    assert out.count("values of 16 calls: 0 wrong elements") == 1, out
    assert out.count("values of 1 calls: 0 wrong elements") == 1, out
    assert status == 0


def test_compare_every_compares_every_nth_call(capsys, monkeypatch):
    status = _main(["--calls", "10", "--max-len", "30", "--long-calls", "0", "--seed", "4",
                    "--compare-every", "4"], monkeypatch)
    out = capsys.readouterr().out
    assert "10 clean fwd+bwd calls" in out and "values of 3 calls: 0 wrong elements" in out, out
    assert status == 0


def _perturbed(module, monkeypatch, which: str):
    """Make the script's fused core return one corrupted element: ``out[0, 0, 0]`` of the
    forward, or ``dq``/``dk``/``dv`` ``[0, 0, 0]`` of the backward, moved by 1e-2 of the
    array's largest magnitude (far above float32's rounding, far below anything else the
    campaign counts: no INF/NaN, no report event)."""
    forward, backward = module.fused_forward, module.fused_backward

    def bump(x):
        x = x.copy()
        x[0, 0, 0] += 1e-2 * (1.0 + float(np.abs(x).max()))
        return x

    def fused_forward(*args, **kwargs):
        out, saved = forward(*args, **kwargs)
        return (bump(out) if which == "out" else out), saved

    def fused_backward(*args, **kwargs):
        grads = list(backward(*args, **kwargs))
        index = ("dq", "dk", "dv").index(which) if which != "out" else None
        if index is not None:
            grads[index] = bump(grads[index])
        return tuple(grads)

    monkeypatch.setattr(module, "fused_forward", fused_forward)
    monkeypatch.setattr(module, "fused_backward", fused_backward)


@pytest.mark.parametrize("which", ["out", "dq", "dk", "dv"])
def test_the_value_comparison_fails_on_a_corrupted_element(which, capsys, monkeypatch):
    module = _load(monkeypatch)
    _perturbed(module, monkeypatch, which)
    status = module.main(["--calls", "8", "--max-len", "40", "--long-calls", "0", "--seed", "3"])
    out = capsys.readouterr().out
    assert status == 1, out
    assert "0 flagged (false positives), 0 raised, 0 with INF/NaN" in out, out
    assert " with wrong values [" in out and ", 0 with wrong values [" not in out.split("\n")[1]
    assert f"wrong values: {which}:" in out, out


def test_clean_calls_match_the_reference(monkeypatch):
    """Every case kind, compared element by element; the tolerance is at
    the rounding level (the largest |diff|/tol well below 1 on float32, not a catch-all: the
    same calls with one element moved by 1e-2 of the largest fail)."""
    module = _load(monkeypatch)
    rng = np.random.default_rng(5)
    tally = module.Tally(dtype=np.dtype(np.float32))
    for call in range(2 * len(module.CASES)):
        case = module.adversarial_case(rng, call, 90, np.dtype(np.float32))
        tally.run(case, f"call {call}")
    assert tally.calls == 16 and tally.wrong == 0 and tally.flagged == 0, tally.first_flags
    assert 0 < tally.worst_ratio < 0.5
    case = module.adversarial_case(np.random.default_rng(1), 7, 64, np.dtype(np.float32))
    values, _ = module.reference_call(case, np.float32)
    got = {name: values[name][0].astype(np.float32) for name in module.VALUES}
    assert module.compare(values, got)[0] == 0
    for name in module.VALUES:
        bad = dict(got)
        bad[name] = got[name].copy()
        bad[name][0, -1, -1] *= 1 + 1e-2
        bad[name][0, -1, -1] += 1e-2 * float(np.abs(got[name]).max())
        assert module.compare(values, bad)[0] >= 1, name


def test_the_sum_over_keys_catches_an_unnormalized_backward(monkeypatch):
    """Rows masked only by float32's lowest number: ``lse = m + log l`` rounds to ``m``, and the
    backward keeps ``log l`` in ``lse_lo``. Without it (``lse_lo`` zeroed, as the kernels once
    were), the recomputed P is 1, not 1/L, and dV is L times too large. The elementwise bound
    cannot resolve such a row (its logits are lost in rounding); the sum over the keys of dV's
    errors (the recomputed P moves by at most about 2 in a row) catches it, and passes the
    backward that keeps ``lse_lo``."""
    module = _load(monkeypatch)
    from attention.context import Context
    from attention.fused import fused_backward, fused_forward

    rng = np.random.default_rng(1)
    q, k, v, do = (rng.standard_normal((1, 100, 16)).astype(np.float32) for _ in range(4))
    mask = np.full((1, 100, 100), np.finfo(np.float32).min, np.float32)
    case = module.Case("probe", q, k, v, do, False, None, mask)
    out, saved = fused_forward(q, k, v, Context(), attn_mask=mask)
    values, unresolved = module.reference_call(case, np.float32)
    assert unresolved == 100
    assert module.compare(values, {"out": out})[0] == 0
    grads = fused_backward(saved, do, Context())
    assert module.compare(values, dict(zip(module.VALUES[1:], grads)))[0] == 0
    lost = dict(saved, lse_lo=np.zeros_like(saved["lse_lo"]))
    grads = fused_backward(lost, do, Context())
    wrong, _, lines = module.compare(values, dict(zip(module.VALUES[1:], grads)))
    assert wrong > 0 and any("summed over the keys" in line for line in lines), lines

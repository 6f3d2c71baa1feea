"""``abftgemm.matmul`` on PyTorch tensors: tensors in, tensors out, no copies, same protection."""
from __future__ import annotations

import numpy as np
import pytest

import abftgemm
from abftgemm.faults import Fault
from tests.conftest import GPU
from fresh_python import run_python

torch = pytest.importorskip("torch", reason="torch is an optional extra (pip install '.[torch]')")

DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(
               GPU is None or not torch.cuda.is_available(), reason="no GPU"))]
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _ints(shape, dtype, device, seed):
    # Small integers: every product is exact in every dtype, so results compare with ==.
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, shape, generator=g).to(dtype=dtype, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tensors_in_tensors_out_equal_torch_matmul(device, dtype):
    a, b = _ints((3, 16, 8), dtype, device, 0), _ints((8, 12), dtype, device, 1)
    c = abftgemm.matmul(a, b)
    assert isinstance(c, torch.Tensor) and c.device == a.device and c.dtype == dtype
    torch.testing.assert_close(c, torch.matmul(a, b), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_faults_are_repaired_and_reported_for_tensors(device):
    a, b = _ints((2, 16, 8), torch.float32, device, 2), _ints((8, 12), torch.float32, device, 3)
    c, report = abftgemm.matmul(a, b, fault_hook=Fault("nan", "row", seed=4), return_report=True)
    assert report.detected and report.corrected == 12
    torch.testing.assert_close(c, torch.matmul(a, b), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_out_and_results_share_memory_with_tensors(device):
    a, b = _ints((16, 8), torch.float32, device, 5), _ints((8, 12), torch.float32, device, 6)
    out = torch.empty((16, 12), device=device)
    assert abftgemm.matmul(a, b, out) is out
    torch.testing.assert_close(out, a @ b, rtol=0, atol=0)
    seen = []
    abftgemm.matmul(a, b, out, fault_hook=lambda site, c: seen.append(c))
    # The hook's array is the tensor's memory (DLPack, no copy): writing it writes out.
    seen[0][0, 0] = 123.0
    assert float(out[0, 0]) == 123.0


def test_tensors_that_record_gradients_are_refused_clearly():
    a = torch.ones((4, 3), requires_grad=True)
    with pytest.raises(TypeError, match="requires grad.*no_grad"):
        abftgemm.matmul(a, torch.ones((3, 2)))
    with torch.no_grad():
        np.testing.assert_array_equal(abftgemm.matmul(a, torch.ones((3, 2))).numpy(), 3.0)


def test_a_tensor_on_another_device_is_refused_clearly():
    """Not an error of the CUDA scope first (on a CPU-only PyTorch, "Torch not compiled with
    CUDA enabled")."""
    with pytest.raises(TypeError, match="a is on meta; abftgemm takes CPU and CUDA tensors"):
        abftgemm.matmul(torch.ones((2, 2), device="meta"), torch.ones((2, 2), device="meta"))


def test_lazy_negations_and_mixed_dtypes_as_torch_matmul():
    """A tensor with its negative bit set is multiplied as torch.matmul multiplies it (an out
    with it is refused: it has no memory of its own); tensors of two dtypes are refused, as
    torch.matmul refuses them (NumPy would promote)."""
    a, b = _ints((4, 6), torch.float32, "cpu", 7), _ints((6, 5), torch.float32, "cpu", 8)
    neg = torch._neg_view(a)
    assert neg.is_neg()
    torch.testing.assert_close(abftgemm.matmul(neg, b), torch.matmul(neg, b), rtol=0, atol=0)
    with pytest.raises(TypeError, match="negative or conjugate bit"):
        abftgemm.matmul(a, b, torch._neg_view(torch.zeros(4, 5)))
    with pytest.raises(TypeError, match="same dtype"):
        abftgemm.matmul(a, b.double())


def test_vector_dot_vector_is_a_0d_tensor():
    got = abftgemm.matmul(torch.arange(4.0), torch.arange(4.0))
    assert isinstance(got, torch.Tensor) and got.shape == () and float(got) == 14.0


@pytest.mark.parametrize("device", DEVICES)
def test_work_is_ordered_with_torchs_current_stream(device):
    """On a side stream, ``out`` is written on that stream: PyTorch reads it on the same stream
    with no synchronization of its own (on the CPU the scope does nothing)."""
    a, b = _ints((64, 32), torch.float32, device, 7), _ints((32, 48), torch.float32, device, 8)
    out = torch.empty((64, 48), device=device)
    if device == "cuda":
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            a2 = a * 2  # queued on the side stream, read by the product
            abftgemm.matmul(a2, b, out)
            got = out.clone()
        torch.cuda.synchronize()
    else:
        got = abftgemm.matmul(a * 2, b, out).clone()
    torch.testing.assert_close(got, (a * 2) @ b, rtol=0, atol=0)


def test_verify_takes_a_tensor_product_and_flags_a_changed_element():
    a, b = torch.randn(4, 64, 32), torch.randn(32, 16)
    c = a @ b
    assert abftgemm.verify(c, a, b).clean
    c[1, 3, 5] += 50.0
    result = abftgemm.verify(c, a, b)
    assert not result.clean and result.report.detected


def test_out_written_in_place_advances_its_version_as_torchs_out():
    """``out`` is written through NumPy/CuPy, behind autograd: its version counter must advance
    as under ``torch.matmul(..., out=)``, or a backward that saved ``out`` silently reads the
    product in place of the values it saved (a wrong gradient, no error)."""
    a, b = _ints((4, 5), torch.float32, "cpu", 9), _ints((5, 3), torch.float32, "cpu", 10)
    w = torch.zeros((4, 3), requires_grad=True)
    y = w.exp()  # saves y for its backward
    with torch.no_grad():
        abftgemm.matmul(a, b, y)
    assert y._version > 0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    out = torch.empty((4, 3))
    with pytest.raises(ValueError):  # refused: nothing written, no new version
        abftgemm.matmul(a, b.T, out)
    assert out._version == 0


def test_outs_torch_refuses_to_write_are_refused_before_writing():
    """An expanded ``out`` (elements sharing memory: each would hold the last value written to
    it) and an inference tensor outside inference mode, which ``torch.matmul(..., out=)``
    refuses, are refused, unwritten."""
    a, b = _ints((4, 5), torch.float32, "cpu", 11), _ints((5, 3), torch.float32, "cpu", 12)
    expanded = torch.full((1, 3), 7.0).expand(4, 3)
    with pytest.raises(ValueError, match="share memory"):
        abftgemm.matmul(a, b, expanded)
    assert bool((expanded == 7.0).all())
    with torch.inference_mode():
        inference = torch.full((4, 3), 7.0)
    with pytest.raises(ValueError, match="inference tensor"):
        abftgemm.matmul(a, b, inference)
    assert bool((inference == 7.0).all())
    with torch.inference_mode():  # inside it, as torch.matmul
        assert abftgemm.matmul(a, b, inference) is inference
    torch.testing.assert_close(inference, a @ b, rtol=0, atol=0)


def test_a_compiled_function_that_calls_it_runs_the_protected_product_untraced():
    """``torch.compile`` of a function calling ``abftgemm.matmul`` on tensors: the call is a
    graph break run as written. Traced, Dynamo failed on its first call in a process (an
    AssertionError from its bytecode analysis, inside Numba's first compilation), so in a
    fresh interpreter."""
    run_python("-c", """
import torch, abftgemm
a, b = torch.arange(20.0).reshape(4, 5), torch.arange(15.0).reshape(5, 3)
f = torch.compile(lambda a, b: abftgemm.matmul(a, b) * 2, backend="eager")
torch.testing.assert_close(f(a, b), (a @ b) * 2, rtol=0, atol=0)
torch.testing.assert_close(f(b.T, a.T), (b.T @ a.T) * 2, rtol=0, atol=0)
""")

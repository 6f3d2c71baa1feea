"""The argument structs of the softmax kernels (``namespace softmax`` of ``softmax.cu``), field for
field in the kernel's order, as :class:`abftgemm.cuda_structs.KernelStruct` lays them out.

They group the kernels' scalars; pointers stay parameters of their own (``softmax.cu`` says why).
Calling one builds a kernel argument (:mod:`attention._cuda_softmax` does); :data:`STRUCTS` lists
them all for the layout checks against the compilers. No CuPy import.
"""
from __future__ import annotations

from abftgemm.cuda_structs import KernelStruct

#: ``n`` rows of ``len`` elements, row r query ``r mod seq_q``; ``causal``: query i sees keys <= i.
ROWS = KernelStruct("softmax::Rows", [("n", "int64"), ("seq_q", "int32"), ("len", "int32"),
                                      ("causal", "int32")])
#: Where the forward's masks hold a matrix's rows: key_visible by batch (matrix // ``heads``),
#: attn_add at matrix * ``attn_stride`` (0: one shared matrix).
MASK_INDEX = KernelStruct("softmax::MaskIndex", [("attn_stride", "int64"), ("heads", "int32")])
#: Compute the output; judge the invariants on what it holds.
MODE = KernelStruct("softmax::Mode", [("compute", "int32"), ("check", "int32")])
#: The forward check's bounds (:func:`attention.softmax.forward_tolerances`, the log floor).
FORWARD_TOLERANCES = KernelStruct("softmax::ForwardTolerances", [
    ("floor", "float64"), ("p_min", "float64"), ("row_tol", "float64"), ("log_base", "float64"),
    ("log_slope", "float64")])
#: The backward check's tolerance (:func:`attention.softmax.backward_tolerance`).
BACKWARD_TOLERANCE = KernelStruct("softmax::BackwardTolerance",
                                  [("u", "float64"), ("tiny", "float64")])

STRUCTS = (ROWS, MASK_INDEX, MODE, FORWARD_TOLERANCES, BACKWARD_TOLERANCE)

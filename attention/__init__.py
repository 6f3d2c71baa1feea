"""Multi-head attention, forward and backward, on checksum-protected GEMMs (:mod:`abftgemm`)."""
from attention.context import Context
from attention.functional import PARAM_KEYS, attention_backward, attention_forward
from attention.layer import MultiHeadAttention
from attention.passes import BACKWARD, FORWARD, Step, Variant
from attention.plan import (ALL_SITES, BACKWARD_SITES, CROSS_SITES, FORWARD_SITES,
                            INVARIANT_SITES, SITES, CheckingPlan, SitePlan, adaptive_frequencies)
from attention.workspace import Workspace

__all__ = ["MultiHeadAttention", "attention_forward", "attention_backward", "Context",
           "Workspace", "SITES", "FORWARD_SITES", "BACKWARD_SITES", "CROSS_SITES", "ALL_SITES",
           "INVARIANT_SITES", "FORWARD", "BACKWARD", "Step", "Variant", "CheckingPlan",
           "SitePlan", "adaptive_frequencies", "PARAM_KEYS"]

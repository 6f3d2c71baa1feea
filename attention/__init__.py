"""Multi-head attention, forward and backward, on checksum-protected GEMMs (:mod:`abftgemm`)."""
from attention.layer import PARAM_KEYS, MultiHeadAttention
from attention.plan import (BACKWARD_SITES, FORWARD_SITES, INVARIANT_SITES, SITES, CheckingPlan,
                            SitePlan, adaptive_frequencies)

__all__ = ["MultiHeadAttention", "SITES", "FORWARD_SITES", "BACKWARD_SITES", "INVARIANT_SITES",
           "CheckingPlan", "SitePlan", "adaptive_frequencies", "PARAM_KEYS"]

"""flashinfer.fused_moe: MoE routing and fused MoE (from the fi-moe package)."""

from ._family import reexport

reexport(globals(), "fi-moe", "fi_moe")

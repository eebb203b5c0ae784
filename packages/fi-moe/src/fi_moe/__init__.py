"""fi-moe: MoE routing, permute/unpermute and fused MoE on fi-gemm's grouped GEMM.

No ops have landed yet: the package installs and imports, exports nothing, and registers nothing in
the support matrix. flashinfer.fused_moe names raise an error that says the op is not available.
"""

from .version import __version__

__all__: list[str] = ["__version__"]

"""flashinfer.page: paged KV cache management (from the fi-attention package)."""

from ._family import reexport

reexport(globals(), "fi-attention", "fi_attention.page")

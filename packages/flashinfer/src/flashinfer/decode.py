"""flashinfer.decode: decode attention over paged KV caches (from the fi-attention package)."""

from ._family import reexport

reexport(globals(), "fi-attention", "fi_attention.decode")

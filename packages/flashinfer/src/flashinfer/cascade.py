"""flashinfer.cascade: attention state merging and cascade attention (from the fi-attention package)."""

from ._family import reexport

reexport(globals(), "fi-attention", "fi_attention.cascade")

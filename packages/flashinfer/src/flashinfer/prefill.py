"""flashinfer.prefill: prefill attention, ragged and paged (from the fi-attention package)."""

from ._family import reexport

reexport(globals(), "fi-attention", "fi_attention.prefill")

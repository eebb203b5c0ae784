"""flashinfer.rope: rotary position embeddings (from the fi-sampling package)."""

from ._family import reexport

reexport(globals(), "fi-sampling", "fi_sampling.rope")

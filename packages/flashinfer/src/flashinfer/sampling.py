"""flashinfer.sampling: sorting-free sampling (from the fi-sampling package)."""

from ._family import reexport

reexport(globals(), "fi-sampling", "fi_sampling.sampling")

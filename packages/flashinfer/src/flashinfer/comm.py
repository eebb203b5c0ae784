"""flashinfer.comm: communication kernels (from the fi-comm package)."""

from ._family import reexport

reexport(globals(), "fi-comm", "fi_comm")

"""fi-comm: custom all-reduce (with fused residual/norm) on top of torch.distributed.

No ops have landed yet: the package installs and imports, exports nothing, and registers nothing in
the support matrix. flashinfer.comm names raise an error that says the op is not available.
"""

from .version import __version__

__all__: list[str] = ["__version__"]

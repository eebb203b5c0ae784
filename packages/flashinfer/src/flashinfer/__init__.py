"""FlashInfer-compatible API over the fi kernel packages.

Code written against FlashInfer runs unchanged for every op fi covers: `flashinfer.decode`,
`.prefill`, `.page`, `.cascade`, `.sampling`, `.norm`, `.rope`, `.activation`, `.gemm`,
`.fused_moe`, `.comm`, `.utils`, and every name flat on `flashinfer`. A family that is not installed
leaves its names raising an ImportError that says which package to install.
"""

from .version import __version__
from . import (
    activation, cascade, comm, decode, fused_moe, gemm, norm, page, prefill, rope, sampling, utils,
)

_MODULES = (decode, prefill, page, cascade, sampling, norm, rope, activation, gemm, fused_moe, comm)

__all__ = ["__version__", "utils"]
for _m in _MODULES:
    for _n in _m.__all__:
        if _n != "__version__":
            globals()[_n] = getattr(_m, _n)
            __all__.append(_n)
del _m, _n


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    missing = [m.__name__ for m in _MODULES if not m.__all__]
    hint = f" (not installed or empty: {', '.join(missing)})" if missing else ""
    raise AttributeError(f"flashinfer has no attribute {name!r}{hint}")

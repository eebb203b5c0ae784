"""fi-sampling: the small kernels of every decoding step: sorting-free sampling, RoPE, RMSNorm /
LayerNorm and gated activations. FlashInfer-compatible names (flashinfer.sampling, .rope, .norm,
.activation re-export these)."""

from .version import __version__
from . import activation, norm, rope, sampling
from .activation import *  # noqa: F401,F403
from .norm import *  # noqa: F401,F403
from .rope import *  # noqa: F401,F403
from .sampling import *  # noqa: F401,F403

__all__ = ["__version__", *activation.__all__, *norm.__all__, *rope.__all__, *sampling.__all__]

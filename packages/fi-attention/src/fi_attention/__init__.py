"""fi-attention: decode and prefill attention over ragged and paged KV caches, page management and
state merging (cascade). FlashInfer-compatible names (flashinfer.decode, .prefill, .page, .cascade
re-export these)."""

from .version import __version__
from . import cascade, decode, page, prefill
from .cascade import *  # noqa: F401,F403
from .decode import *  # noqa: F401,F403
from .page import *  # noqa: F401,F403
from .prefill import *  # noqa: F401,F403

__all__ = ["__version__", *cascade.__all__, *decode.__all__, *page.__all__, *prefill.__all__]

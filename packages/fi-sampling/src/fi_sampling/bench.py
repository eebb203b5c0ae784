"""fi-sampling benchmark routines: importing this module registers them (one import per area)."""

from . import bench_rope  # noqa: F401
from . import bench_sampling  # noqa: F401
from . import bench_norm  # noqa: F401

"""`flashinfer` command line (also `python -m flashinfer`)."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    from fi_core.cli import main as core_main  # noqa: PLC0415

    from .demo import add_demo_command  # noqa: PLC0415

    return core_main(argv, prog="flashinfer", extra=[add_demo_command])


if __name__ == "__main__":
    sys.exit(main())

"""Re-export a family's names under a FlashInfer module path, or explain how to get them.

`flashinfer.norm` re-exports `fi_sampling.norm.__all__`. When fi-sampling is not installed,
`import flashinfer.norm` still works and touching any name raises an ImportError that names the
package to install.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType
from typing import Optional


class MissingFamilyError(ImportError):
    """The fi package that provides a flashinfer name is not installed."""


def reexport(namespace: dict, dist: str, module: str, extra: Optional[dict] = None) -> bool:
    """Copy `module.__all__` into `namespace` (a flashinfer submodule's globals).

    Returns True when the family is installed. Otherwise installs a module-level __getattr__
    that raises MissingFamilyError for any public name.
    """
    here = namespace["__name__"]
    if importlib.util.find_spec(module.split(".")[0]) is None:
        def __getattr__(name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            raise MissingFamilyError(
                f"{here}.{name} is provided by the '{dist}' package, which is not installed: "
                f"pip install {dist}")
        namespace["__getattr__"] = __getattr__
        namespace["__all__"] = []
        return False
    mod: ModuleType = importlib.import_module(module)
    names = [n for n in getattr(mod, "__all__", []) if not n.startswith("__")]
    for n in names:
        namespace[n] = getattr(mod, n)
    for alias, target in (extra or {}).items():
        if hasattr(mod, target):
            namespace[alias] = getattr(mod, target)
            names.append(alias)

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"module {here!r} has no attribute {name!r}: fi's {dist} does not provide this "
            f"FlashInfer name yet (provided: {', '.join(sorted(names)) or 'none'})")
    namespace["__getattr__"] = __getattr__
    namespace["__all__"] = names
    return True

"""Names of a package loaded on first use (PEP 562), so that importing the
package, or a reader of traces and checkpoints in it, loads neither MPI nor
Numba: MPI initialises only when something collective is made."""
from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, List, Mapping, Tuple


def exports(package: str, where: Mapping[str, str], namespace: Dict[str, Any]
            ) -> Tuple[Callable[[str], Any], Callable[[], List[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` for the names of ``where``
    (name -> the relative module that defines it); ``namespace`` is the
    package's ``globals()``, where a name once loaded stays as a plain attribute."""

    def __getattr__(name: str) -> Any:  # noqa: N807 (the module attribute PEP 562 names)
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        namespace[name] = value
        return value

    def __dir__() -> List[str]:  # noqa: N807
        return sorted(set(namespace) | set(where))

    return __getattr__, __dir__

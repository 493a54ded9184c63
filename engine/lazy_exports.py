"""Package attributes that import their module when first read (PEP 562), so that importing a
package stays cheap: ``specserve pull`` and the API process never load torch through it."""

import importlib


def lazy_exports(package: str, exports: dict[str, str], renamed: dict[str, str] | None = None):
    """A module ``__getattr__`` that resolves each name of ``exports`` (name -> module) from
    its module, under the module's own name where ``renamed`` gives one."""
    renamed = renamed or {}

    def __getattr__(name: str):
        if name in exports:
            return getattr(importlib.import_module(exports[name]), renamed.get(name, name))
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__

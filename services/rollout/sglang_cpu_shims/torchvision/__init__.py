"""Stand-in for torchvision on SGLang's CPU server.

SGLang imports torchvision at start-up through multimodal config modules (for example
`srt/multimodal/internvl_utils.py`) even when serving a text model, and PyPI's torchvision does
not load beside the CPU torch ("operator torchvision::nms does not exist"). Here every
`torchvision.*` submodule imports, every name in it is a placeholder class (attribute access on
it, such as `InterpolationMode.BICUBIC` at import time, gives another placeholder), and calling
one raises: a multimodal model fails loudly instead of running on a fake.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+lorafleet.stand-in"


class _Placeholder(type):
    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")

    def __call__(cls, *args: object, **kwargs: object) -> None:
        raise RuntimeError(
            f"torchvision.{cls.__qualname__} was used, but torchvision is lorafleet's stand-in "
            "on the SGLang CPU server (text models only)"
        )


def _placeholder(qualname: str) -> type:
    return _Placeholder(qualname.rsplit(".", 1)[-1], (), {"__qualname__": qualname})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{self.__name__.removeprefix('torchvision.')}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes any `torchvision.<sub>` module on import."""

    def find_spec(self, fullname, path, target=None):  # type: ignore[no-untyped-def]
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):  # type: ignore[no-untyped-def]
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):  # type: ignore[no-untyped-def]
        return None


sys.meta_path.insert(0, _Finder())
_self = sys.modules[__name__]
_self.__class__ = _StubModule

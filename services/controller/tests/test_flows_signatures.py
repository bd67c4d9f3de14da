"""The flows take parts and domain values, never a request message nor the Controller.

Every public function and method of every module under `lorafleet_controller/flows` is
checked: no parameter or return annotation names a protobuf request message (a class of a
`_pb2` module whose name ends in `Request`), and no flow module imports `controller`. The
servicer converts requests at the edge (`convert.py`); `controller.py` only wires.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import typing
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from lorafleet.v1 import controller_pb2
from lorafleet_controller import flows

from .test_import_graph import import_graph, module_sources

CONTROLLER = "lorafleet_controller.controller"


def flow_modules() -> list[ModuleType]:
    names = [m.name for m in pkgutil.walk_packages(flows.__path__, f"{flows.__name__}.")]
    return [flows, *(importlib.import_module(name) for name in sorted(names))]


def public_callables(module: ModuleType) -> Iterator[tuple[str, Any]]:
    """(qualified name, function) of the module's own public functions and class methods."""
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            yield name, obj
        elif inspect.isclass(obj):
            for attr, member in vars(obj).items():
                if inspect.isfunction(member) and (attr == "__init__" or not attr.startswith("_")):
                    yield f"{name}.{attr}", member


def named_types(hint: Any) -> Iterator[Any]:
    """Every class a (possibly generic or union) type hint names."""
    yield hint
    for arg in typing.get_args(hint):
        yield from named_types(arg)


def is_request(tp: Any) -> bool:
    return (
        inspect.isclass(tp) and tp.__module__.endswith("_pb2") and tp.__name__.endswith("Request")
    )


def request_annotations(module: ModuleType) -> list[str]:
    found = []
    for qualname, fn in public_callables(module):
        hints = typing.get_type_hints(fn)
        inspect.signature(fn)  # every public callable has a signature to check
        for param, hint in hints.items():
            found += [
                f"{module.__name__}.{qualname}({param}: {tp.__name__})"
                for tp in named_types(hint)
                if is_request(tp)
            ]
    return found


def test_the_walk_finds_every_flow_and_its_callables() -> None:
    modules = {m.__name__.rsplit(".", 1)[-1] for m in flow_modules()}
    assert {"registrations", "sessions", "operations", "replicas", "sweeper"} <= modules
    names = {q for m in flow_modules() for q, _ in public_callables(m)}
    assert {"Registrations.create", "Replicas.register", "Sweeper.sweep_once"} <= names


def test_no_flow_takes_or_returns_a_request_message() -> None:
    found = [hit for module in flow_modules() for hit in request_annotations(module)]
    assert not found, "flows naming request messages:\n" + "\n".join(found)


def test_the_check_sees_a_request_in_any_annotation_shape() -> None:
    async def takes(req: controller_pb2.CreateRegistrationRequest) -> None: ...
    def nested(reqs: list[controller_pb2.SubmitOperationRequest] | None) -> None: ...
    def fine(info: controller_pb2.OperationPayload) -> None: ...

    module = ModuleType("probe")
    for fn in (takes, nested, fine):
        fn.__module__ = "probe"
        setattr(module, fn.__name__, fn)
    assert request_annotations(module) == [
        "probe.takes(req: CreateRegistrationRequest)",
        "probe.nested(reqs: SubmitOperationRequest)",
    ]


def test_no_flow_imports_the_controller() -> None:
    graph = import_graph(module_sources())
    found = [m.__name__ for m in flow_modules() if CONTROLLER in graph[m.__name__]]
    assert not found, f"flow modules importing the controller: {found}"


def test_the_import_check_sees_every_import_shape() -> None:
    def edges(source: str) -> set[str]:
        sources = {
            "lorafleet_controller": ("", True),
            "lorafleet_controller.controller": ("", False),
            "lorafleet_controller.flows": ("", True),
            "lorafleet_controller.flows.runs": ("", False),
            "lorafleet_controller.flows.probe": (source, False),
        }
        return import_graph(sources)["lorafleet_controller.flows.probe"]

    for source in (
        "import lorafleet_controller.controller\n",
        "from lorafleet_controller import controller\n",
        "from lorafleet_controller.controller import Controller\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import controller\n",
        "from ..controller import Controller\n",
    ):
        assert CONTROLLER in edges(source), source
    assert CONTROLLER not in edges("from . import runs\n")

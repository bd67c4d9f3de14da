"""The flows take parts and domain values, never a request message nor the Controller.

Every public function and method of every controller module but the gRPC edges (the
servicers, `convert.py`, `clients.py`) is checked: no parameter or return annotation names a
protobuf request message (a class of a `_pb2` module whose name ends in `Request`), and no
flow module imports `controller`. The servicer converts requests at the edge
(`convert.py`); `controller.py` only wires.
"""

from __future__ import annotations

import builtins
import importlib
import inspect
import pkgutil
import re
import typing
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import lorafleet_controller
from lorafleet.v1 import controller_pb2
from lorafleet_controller import flows

from .test_import_graph import import_graph, module_sources

CONTROLLER = "lorafleet_controller.controller"


def flow_modules() -> list[ModuleType]:
    names = [m.name for m in pkgutil.walk_packages(flows.__path__, f"{flows.__name__}.")]
    return [flows, *(importlib.import_module(name) for name in sorted(names))]


EDGES = {"servicer", "jobs_servicer", "convert", "clients"}
"""The modules that speak gRPC: they take requests and convert them (or build them)."""


def domain_modules() -> list[ModuleType]:
    """Every module of the controller but the edges: the flows and the parts they use."""
    names = [
        m.name
        for m in pkgutil.walk_packages(lorafleet_controller.__path__, "lorafleet_controller.")
        if m.name.rsplit(".", 1)[-1] not in EDGES | {"__main__"}
    ]
    return [importlib.import_module(name) for name in sorted(names)]


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


def _resolved(module: ModuleType, annotation: Any) -> Iterator[Any]:
    """The classes an annotation names. A string annotation (postponed evaluation) is read
    name by name in the module's namespace; a name imported only for type checking does
    not resolve and is not a protobuf message (those are imported at run time)."""
    if not isinstance(annotation, str):
        yield from named_types(annotation)
        return
    for dotted in re.findall(r"[A-Za-z_][\w.]*", annotation):
        head, *rest = dotted.split(".")
        obj = vars(module).get(head, getattr(builtins, head, None))
        for part in rest:
            obj = getattr(obj, part, None)
        if obj is not None:
            yield obj


def request_annotations(module: ModuleType) -> list[str]:
    found = []
    for qualname, fn in public_callables(module):
        inspect.signature(fn)  # every public callable has a signature to check
        for param, annotation in fn.__annotations__.items():
            found += [
                f"{module.__name__}.{qualname}({param}: {tp.__name__})"
                for tp in _resolved(module, annotation)
                if is_request(tp)
            ]
    return found


def test_the_walk_finds_every_flow_and_its_callables() -> None:
    modules = {m.__name__.rsplit(".", 1)[-1] for m in flow_modules()}
    assert {"registrations", "sessions", "operations", "replicas", "sweeper"} <= modules
    names = {q for m in flow_modules() for q, _ in public_callables(m)}
    assert {"Registrations.create", "Replicas.register", "Sweeper.sweep_once"} <= names


def test_no_flow_takes_or_returns_a_request_message() -> None:
    """Nor does any part a flow uses: only the edges see requests."""
    modules = domain_modules()
    assert {m.__name__ for m in flow_modules()} <= {m.__name__ for m in modules}
    assert {"lorafleet_controller.samplers", "lorafleet_controller.publish"} <= {
        m.__name__ for m in modules
    }
    found = [hit for module in modules for hit in request_annotations(module)]
    assert not found, "domain modules naming request messages:\n" + "\n".join(found)


def test_the_check_sees_a_request_in_any_annotation_shape() -> None:
    async def takes(req: controller_pb2.CreateRegistrationRequest) -> None: ...
    def nested(reqs: list[controller_pb2.SubmitOperationRequest] | None) -> None: ...
    def fine(info: controller_pb2.OperationPayload) -> None: ...

    module = ModuleType("probe")
    module.controller_pb2 = controller_pb2  # type: ignore[attr-defined]
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

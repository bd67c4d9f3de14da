"""Build the Grafana dashboards of the Helm chart with grafana-foundation-sdk.

The JSON under deploy/helm/lorafleet/dashboards/ is generated, never edited by hand, so a
review reads the panels and their PromQL here. Run `python deploy/dashboards/build.py` after
a change; `--check` fails when the checked-in JSON differs (tests/deploy runs it).

Dashboards, panels, queries and the datasource variable are built with Grafana's own
dashboards-as-code library (its builders know the schema; this file only says what to show).
Every query goes through one Prometheus datasource variable, and `$__rate_interval` is the
only Grafana macro used, so the queries can be run verbatim against a real Prometheus once it
is substituted (tests/deploy/test_prometheus.py does that).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard as gdash
from grafana_foundation_sdk.builders import prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as gmodel

OUT_DIR = Path(__file__).resolve().parents[1] / "helm" / "lorafleet" / "dashboards"
DATASOURCE = gmodel.DataSourceRef(type_val="prometheus", uid="${datasource}")
RATE = "[$__rate_interval]"
HEIGHT = 8


@dataclass
class Panel:
    """One panel: a title, its queries as (expr, legend) pairs, a unit, and a kind."""

    title: str
    queries: list[tuple[str, str]]
    unit: str = "short"
    kind: str = "timeseries"
    description: str = ""
    width: int = 12


def rate(metric: str, by: str = "", selector: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({metric}{selector}{RATE}))"


def quantile(q: float, bucket: str, by: str = "", selector: str = "") -> str:
    labels = ", ".join(["le", *([by] if by else [])])
    return f"histogram_quantile({q}, sum by ({labels}) (rate({bucket}{selector}{RATE})))"


def _panel(panel: Panel, panel_id: int, x: int, y: int) -> timeseries.Panel | stat.Panel:
    builder = stat.Panel() if panel.kind == "stat" else timeseries.Panel()
    builder = (
        builder.id(panel_id)
        .title(panel.title)
        .description(panel.description)
        .datasource(DATASOURCE)
        .unit(panel.unit)
        .grid_pos(gmodel.GridPos(h=HEIGHT, w=panel.width, x=x, y=y))
    )
    for i, (expr, legend) in enumerate(panel.queries):
        builder = builder.with_target(
            prometheus.Dataquery()
            .ref_id(chr(ord("A") + i))
            .datasource(DATASOURCE)
            .expr(expr)
            .legend_format(legend)
        )
    return builder


def dashboard(uid: str, title: str, description: str, panels: list[Panel]) -> dict:
    """A dashboard with a Prometheus datasource variable and panels laid out two per row."""
    board = (
        gdash.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["lorafleet"])
        .editable()
        .version(1)
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .with_variable(
            gdash.DatasourceVariable("datasource").label("Prometheus").type("prometheus")
        )
    )
    x, y = 0, 0
    for i, panel in enumerate(panels, start=1):
        if x + panel.width > 24:
            x, y = 0, y + HEIGHT
        board = board.with_panel(_panel(panel, i, x, y))
        x += panel.width
    # Round-trip through the library's encoder: the file holds exactly what it serialises.
    return json.loads(json.dumps(board.build(), cls=JSONEncoder))


_HANDLED = rate("grpc_server_handled_total", "grpc_service")
_FAILED = rate("grpc_server_handled_total", "grpc_service", '{grpc_code!="OK"}')
ERROR_RATIO = f"({_FAILED} or {_HANDLED} * 0) / {_HANDLED}"


def fleet_overview() -> dict:
    return dashboard(
        "lorafleet-fleet-overview",
        "lorafleet / Fleet overview",
        "Traffic, errors and latency of every service; slot occupancy and open operations.",
        [
            Panel(
                "gRPC requests by service",
                [(rate("grpc_server_handled_total", "grpc_service"), "{{grpc_service}}")],
                "reqps",
            ),
            Panel(
                "gRPC error ratio by service",
                [(ERROR_RATIO, "{{grpc_service}}")],
                "percentunit",
                description="Share of finished RPCs whose status is not OK (0 when all are OK).",
            ),
            Panel(
                "gRPC p95 latency by method",
                [
                    (
                        quantile(0.95, "grpc_server_handling_seconds_bucket", "grpc_method"),
                        "{{grpc_method}}",
                    )
                ],
                "s",
            ),
            Panel(
                "gRPC calls started by method",
                [(rate("grpc_server_started_total", "grpc_method"), "{{grpc_method}}")],
                "reqps",
            ),
            Panel(
                "HTTP requests by route and status",
                [(rate("lorafleet_http_requests_total", "route, status"), "{{route}} {{status}}")],
                "reqps",
            ),
            Panel(
                "HTTP p95 latency by route",
                [(quantile(0.95, "lorafleet_http_request_seconds_bucket", "route"), "{{route}}")],
                "s",
            ),
            Panel(
                "Slots by state",
                [("sum by (state) (lorafleet_registry_slots)", "{{state}}")],
                description="Fleet-wide LoRA slots bound to a model or free, from the registry.",
            ),
            Panel(
                "Open operations by state",
                [("sum by (state) (lorafleet_ledger_operations)", "{{state}}")],
            ),
        ],
    )


PAGE_OUT = "lorafleet_registry_page_out_seconds_bucket"
PAGE_IN = "lorafleet_registry_page_in_seconds_bucket"


def training() -> dict:
    return dashboard(
        "lorafleet-training",
        "lorafleet / Training",
        "Trainer replicas: slot use, throughput, step latency, non-finite vetoes, state I/O, "
        "paging.",
        [
            Panel(
                "Trainer slots by state",
                [("sum by (instance, state) (lorafleet_trainer_slots)", "{{instance}} {{state}}")],
            ),
            Panel(
                "Tokens trained per second",
                [(rate("lorafleet_trainer_tokens_total", "instance"), "{{instance}}")],
                "short",
            ),
            Panel(
                "Optimizer steps per second",
                [(rate("lorafleet_trainer_optim_steps_total", "instance"), "{{instance}}")],
                "short",
            ),
            Panel(
                "Non-finite vetoes (1h)",
                [("sum(increase(lorafleet_trainer_nonfinite_vetoes_total[1h]))", "vetoes")],
                kind="stat",
                description="Optimizer steps skipped because a gradient window was not finite.",
                width=6,
            ),
            Panel(
                "Queued registrations",
                [("sum(lorafleet_registry_queued)", "queued")],
                kind="stat",
                description="Models waiting for a free trainer slot.",
                width=6,
            ),
            Panel(
                "Trainer op latency by kind",
                [
                    (quantile(0.5, "lorafleet_trainer_op_seconds_bucket", "kind"), "p50 {{kind}}"),
                    (quantile(0.95, "lorafleet_trainer_op_seconds_bucket", "kind"), "p95 {{kind}}"),
                ],
                "s",
            ),
            Panel(
                "State save/load p95",
                [(quantile(0.95, "lorafleet_trainer_state_io_seconds_bucket", "op"), "{{op}}")],
                "s",
            ),
            Panel(
                "TrainerService p95 by method",
                [
                    (
                        quantile(
                            0.95,
                            "grpc_server_handling_seconds_bucket",
                            "grpc_method",
                            '{grpc_service="lorafleet.v1.TrainerService"}',
                        ),
                        "{{grpc_method}}",
                    )
                ],
                "s",
            ),
            Panel(
                "Paging: runs paged out and in per second",
                [
                    (rate(PAGE_OUT, selector='{le="+Inf"}'), "paged out"),
                    (rate(PAGE_IN, selector='{le="+Inf"}'), "paged in"),
                ],
                "short",
                description="Idle runs paged out of their slot for waiting ones, and paged runs "
                "restored on their next operation (controller paging.py).",
            ),
            Panel(
                "Paging: page-out and page-in p50/p99",
                [
                    (quantile(0.5, PAGE_OUT), "page-out p50"),
                    (quantile(0.99, PAGE_OUT), "page-out p99"),
                    (quantile(0.5, PAGE_IN), "page-in p50"),
                    (quantile(0.99, PAGE_IN), "page-in p99"),
                ],
                "s",
                description="Page-out: the slot's snapshot until the slot is free. Page-in: "
                "the restore into a new slot (bind, load, replay), not the wait for one.",
            ),
        ],
    )


def sampling() -> dict:
    return dashboard(
        "lorafleet-sampling",
        "lorafleet / Sampling",
        "Rollout replicas: resident adapters, throughput, time to first token, queues, publish.",
        [
            Panel(
                "Adapters loaded",
                [("sum by (instance) (lorafleet_rollout_adapters_loaded)", "{{instance}}")],
            ),
            Panel(
                "Tokens sampled per second",
                [(rate("lorafleet_rollout_tokens_total", "instance"), "{{instance}}")],
            ),
            Panel(
                "Time to first token",
                [
                    (quantile(0.5, "lorafleet_rollout_ttft_seconds_bucket"), "p50"),
                    (quantile(0.95, "lorafleet_rollout_ttft_seconds_bucket"), "p95"),
                ],
                "s",
            ),
            Panel(
                "Queue depth",
                [("sum by (instance) (lorafleet_rollout_queue_depth)", "{{instance}}")],
            ),
            Panel(
                "Sample requests by outcome",
                [(rate("lorafleet_rollout_requests_total", "outcome"), "{{outcome}}")],
                "reqps",
            ),
            Panel(
                "Adapter publish p95",
                [(quantile(0.95, "lorafleet_publish_latency_seconds_bucket"), "p95")],
                "s",
                description="save_weights_for_sampler until every rollout replica has the version.",
            ),
            Panel(
                "Adapter cache per second",
                [
                    (rate("lorafleet_rollout_adapter_lookups_total", "result"), "{{result}}"),
                    (rate("lorafleet_rollout_adapter_loads_total", "cause"), "load ({{cause}})"),
                    (rate("lorafleet_rollout_adapter_evictions_total"), "evictions"),
                ],
                "reqps",
                description="Samples on an adapter already in the engine (hit) or loaded first "
                "(miss); loads by cause (a publish, or a sample of an evicted version); idle "
                "versions evicted to make room.",
            ),
            Panel(
                "Adapters held and load time",
                [
                    ("sum by (instance) (lorafleet_rollout_adapters_stored)", "held {{instance}}"),
                    (quantile(0.95, "lorafleet_rollout_adapter_load_seconds_bucket"), "load p95"),
                ],
                description="Versions each rollout keeps and serves, loaded in its engine or not "
                "(the loaded ones are in 'Adapters loaded'), and the p95 time to load one.",
            ),
        ],
    )


def ledger() -> dict:
    return dashboard(
        "lorafleet-ledger",
        "lorafleet / Ledger",
        "The controller's operation ledger: backlog, latency, gap stalls and backpressure.",
        [
            Panel(
                "Operations by state",
                [("sum by (state) (lorafleet_ledger_operations)", "{{state}}")],
            ),
            Panel(
                "Operation latency by kind",
                [
                    (
                        quantile(0.5, "lorafleet_operation_latency_seconds_bucket", "kind"),
                        "p50 {{kind}}",
                    ),
                    (
                        quantile(0.99, "lorafleet_operation_latency_seconds_bucket", "kind"),
                        "p99 {{kind}}",
                    ),
                ],
                "s",
            ),
            Panel(
                "Gap stalls",
                [("sum(lorafleet_ledger_gap_stalls)", "stalled")],
                description="Registrations whose next seq_id is missing; sealed after the timeout.",
            ),
            Panel(
                "Backpressure rejections by scope",
                [
                    (
                        f"{rate('lorafleet_ledger_backpressure_total', 'scope')} or vector(0)",
                        "{{scope}}",
                    )
                ],
                "reqps",
                description="Submissions refused with RESOURCE_EXHAUSTED (0 when there are none).",
            ),
            Panel(
                "Admission load against the fleet's limits",
                [
                    (
                        "max by (kind) (lorafleet_admission_load) "
                        "/ max by (kind) (lorafleet_admission_limit)",
                        "{{kind}}",
                    )
                ],
                "percentunit",
                description="Open operations, unacknowledged results and their bytes, as a "
                "fraction of the MAX_*_GLOBAL settings: at 1 every tenant's next submission of "
                "that kind is refused with backpressure.",
            ),
            Panel(
                "Slots by replica",
                [("sum by (replica, state) (lorafleet_registry_slots)", "{{replica}} {{state}}")],
            ),
            Panel(
                "ControllerService requests by method and code",
                [
                    (
                        rate(
                            "grpc_server_handled_total",
                            "grpc_method, grpc_code",
                            '{grpc_service="lorafleet.v1.ControllerService"}',
                        ),
                        "{{grpc_method}} {{grpc_code}}",
                    )
                ],
                "reqps",
            ),
        ],
    )


DASHBOARDS = {
    "fleet-overview": fleet_overview,
    "training": training,
    "sampling": sampling,
    "ledger": ledger,
}


def render() -> dict[str, str]:
    """File name → JSON text for every dashboard."""
    return {
        f"{name}.json": json.dumps(build(), indent=2, sort_keys=True) + "\n"
        for name, build in DASHBOARDS.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the JSON files are stale")
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print(f"stale dashboards (run deploy/dashboards/build.py): {', '.join(stale)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

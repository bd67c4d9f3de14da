"""`make images` tags what the chart deploys: one source for names and tags (fast, no build)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "lorafleet"

_spec = importlib.util.spec_from_file_location("lorafleet_images", REPO / "deploy/images/build.py")
assert _spec is not None and _spec.loader is not None
images_build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(images_build)


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"image": {"registry": "registry.example:5000", "tag": "2.0"}},
        {"image": {"registry": ""}},
    ],
    ids=["default", "own-registry-and-tag", "no-registry"],
)
def test_the_chart_deploys_the_images_make_images_tags(values: dict, tmp_path: Path) -> None:
    helm_python = pytest.importorskip("helm_python")
    chart_copy = tmp_path / "lorafleet"
    shutil.copytree(CHART, chart_copy)
    merged = yaml.safe_load((chart_copy / "values.yaml").read_text())
    merged["image"].update(values.get("image", {}))
    (chart_copy / "values.yaml").write_text(yaml.safe_dump(merged, sort_keys=False))
    chart = helm_python.Chart.load(str(chart_copy))
    try:
        files = chart.render(values={"rollout": {"engine": "torch"}}, name="rel", namespace="ml")
    finally:
        chart.close()
    deployed = {
        container["image"]
        for path, text in files.items()
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc and doc["kind"] in ("Deployment", "StatefulSet")
        for container in doc["spec"]["template"]["spec"]["containers"]
        if "/lorafleet/" in container["image"] or container["image"].startswith("lorafleet/")
    }
    old = images_build.CHART
    images_build.CHART = chart_copy
    try:
        built = set(images_build.refs().values())
    finally:
        images_build.CHART = old
    assert deployed == built
    assert len(built) == 4

"""Builds the fleet's four images (`services/*/Containerfile`) under the names and tags the
Helm chart deploys, and says what it built.

One place for image names: the chart. `refs()` reads `deploy/helm/lorafleet/values.yaml`
(`image.registry`, each component's `image.repository` and tag, else `image.tag`, else the
chart's appVersion), so `make images` and `helm install` always agree.

Why a script and not a Makefile loop: the same steps serve `make images` and the slow tier
that starts the fleet from the images (`tests/images/`), and they need a little logic:
- the engine: docker where a daemon answers, else buildah (daemonless, `chroot` isolation:
  runs as root in a sandbox without user namespaces; overlay storage, or STORAGE_DRIVER=vfs);
- the base: `--base`, else docker's public `python:3.11-slim-bookworm`, else (buildah, no
  registry) a Debian 12 root bootstrapped here with mmdebstrap and committed as
  `localhost/lorafleet/base:bookworm`;
- the wheelhouse: every wheel the images install, downloaded by the host's pip
  (`.cache/images/wheels`), so builds are offline, reproducible and get the CPU torch
  (pip's own configuration finds it; elsewhere pass `--torch-index`);
- reuse: each image is also tagged `content-<digest>` of everything it is built from
  (Containerfile, the files it copies, requirements, wheelhouse, base image, flavor); a
  build whose digest already exists is skipped. Otherwise buildah's layer cache (`--layers`)
  keeps what did not change: the Containerfiles install the dependencies before copying our
  sources, so a source change redoes only our packages' layers.

Commands (`python deploy/images/build.py ...`): `refs` (the references, one a line),
`base`, `wheels`, `build [SERVICE...]` (prints a JSON report: per image its reference,
content tag, size in bytes, seconds, and whether it was reused).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "lorafleet"
SERVICES = ("controller", "trainer", "rollout", "gateway")
#: Services that carry torch, and so have a GPU flavour (`--gpu`, tag suffix "-gpu").
TORCH_SERVICES = ("trainer", "rollout")
WHEELS = REPO / ".cache" / "images" / "wheels"
#: The machine's wheelhouses, one per requirements digest, hard-linked into WHEELS (the build
#: context can hold no link out of it): a clean clone on the same machine (CI) fills its
#: wheelhouse in a second instead of downloading again, as tests/cached_venv.sh does for venvs.
#: The images themselves are machine-wide already (buildah's or docker's storage).
WHEEL_CACHE = Path(
    os.environ.get("LORAFLEET_IMAGE_CACHE") or Path.home() / ".cache" / "lorafleet" / "images"
)
LOCAL_BASE = "localhost/lorafleet/base:bookworm"
PUBLIC_BASE = "docker.io/library/python:3.11-slim-bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
#: Wheels the images need beyond requirements.txt: pip and setuptools (the builder installs
#: our packages from source), and async-timeout, which redis requires below Python 3.11.3:
#: Debian 12's Python is 3.11.2, and `pip download` judges markers by the host's Python.
EXTRA_WHEELS = ("pip", "setuptools>=68", "async-timeout>=4.0.3")
#: buildah's storage driver: overlay (kernel overlayfs, as root) shares layers instead of
#: copying them, which made a torch image's build and each container start minutes faster
#: here; STORAGE_DRIVER=vfs works on any filesystem and in sandboxes without overlay mounts
#: (platform.md §10).
STORAGE_DRIVER = os.environ.get("STORAGE_DRIVER") or "overlay"
BUILDAH = ("buildah", "--storage-driver", STORAGE_DRIVER)


def refs(gpu: bool = False) -> dict[str, str]:
    """service -> the image reference the chart deploys (with "-gpu" appended to the tag of
    the torch services' GPU flavour)."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    version = str(yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"])
    registry = values["image"].get("registry") or ""
    out = {}
    for service in SERVICES:
        image = values[service]["image"]
        tag = image.get("tag") or values["image"].get("tag") or version
        if gpu:
            if service not in TORCH_SERVICES:
                continue
            tag += "-gpu"
        repository = f"{registry}/{image['repository']}" if registry else image["repository"]
        out[service] = f"{repository}:{tag}"
    return out


def chart_version() -> str:
    return str(yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"])


def engine() -> str:
    """ "docker" where a docker daemon answers, else "buildah" (installed by `make images`)."""
    if shutil.which("docker") and _quiet(["docker", "info"]):
        return "docker"
    if shutil.which("buildah"):
        return "buildah"
    raise SystemExit("images: neither a docker daemon nor buildah here (apt-get install buildah)")


def _quiet(command: list[str]) -> bool:
    return subprocess.run(command, capture_output=True, check=False).returncode == 0


def _tool(kind: str) -> tuple[str, ...]:
    return BUILDAH if kind == "buildah" else ("docker",)


def image_id(kind: str, ref: str) -> str | None:
    """The local image's ID, or None when it does not exist."""
    out = subprocess.run(
        [*_tool(kind), "image", "inspect", "--format", "{{.Id}}", ref]
        if kind == "docker"
        else [*BUILDAH, "inspect", "--type", "image", "--format", "{{.FromImageID}}", ref],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return out.stdout.strip() or None if out.returncode == 0 else None


def image_size(kind: str, ref: str) -> int:
    """Bytes the image takes unpacked (what a node stores)."""
    if kind == "docker":
        out = subprocess.run(["docker", "image", "inspect", "--format", "{{.Size}}", ref],
                             capture_output=True, text=True, check=True)  # fmt: skip
        return int(out.stdout.strip())
    listed = subprocess.run([*BUILDAH, "images", "--json", ref], capture_output=True, text=True,
                            check=True)  # fmt: skip
    number, unit = json.loads(listed.stdout)[0]["size"].split()  # "680 MB": decimal units
    return round(float(number) * {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}[unit])


def ensure_base(kind: str) -> str:
    """The local Debian 12 base (Python 3.11, CA certificates), bootstrapped when missing."""
    if image_id(kind, LOCAL_BASE):
        return LOCAL_BASE
    if not shutil.which("mmdebstrap"):
        raise SystemExit("images: no base image and no mmdebstrap (apt-get install mmdebstrap)")
    with tempfile.TemporaryDirectory(dir=REPO / ".cache") as tmp:
        root = Path(tmp) / "rootfs.tar"
        subprocess.run(
            ["mmdebstrap", "--variant=minbase", "--include=python3,ca-certificates", "bookworm",
             str(root), DEBIAN_MIRROR],
            check=True,
        )  # fmt: skip
        if kind == "docker":
            subprocess.run(["docker", "import", str(root), LOCAL_BASE], check=True,
                           stdout=sys.stderr)  # fmt: skip
        else:
            container = subprocess.run([*BUILDAH, "from", "scratch"], capture_output=True,
                                       text=True, check=True).stdout.strip()  # fmt: skip
            try:
                subprocess.run([*BUILDAH, "add", container, str(root), "/"], check=True,
                               capture_output=True)  # fmt: skip
                subprocess.run([*BUILDAH, "commit", "-q", container, LOCAL_BASE], check=True,
                               stdout=sys.stderr)  # fmt: skip
            finally:
                subprocess.run([*BUILDAH, "rm", container], capture_output=True, check=False)
    return LOCAL_BASE


def fill_wheels(torch_index: str | None = None) -> None:
    """Fill WHEELS with every wheel the CPU images install, from the machine's cached
    wheelhouse for these requirements, downloaded there first when missing (the host pip's
    configuration and caches; `torch_index` adds an index for the CPU torch, e.g. PyTorch's)."""
    stamp = WHEELS / ".complete"
    wanted = hashlib.sha256(
        (REPO / "requirements.txt").read_bytes() + f"{EXTRA_WHEELS}{torch_index}".encode()
    ).hexdigest()
    if stamp.exists() and stamp.read_text() == wanted:
        return  # filled for these requirements: no index lookups (warm builds stay offline)
    cached = WHEEL_CACHE / f"wheels-{wanted[:16]}"
    if not (cached / ".complete").exists():
        shutil.rmtree(cached, ignore_errors=True)
        command = [sys.executable, "-m", "pip", "download", "-q", "--only-binary", ":all:",
                   "-d", str(cached), "-r", str(REPO / "requirements.txt"),
                   *EXTRA_WHEELS]  # fmt: skip
        if torch_index:
            command += ["--extra-index-url", torch_index]
        subprocess.run(command, check=True)
        torches = [p.name for p in cached.glob("torch-*.whl")]
        if not torches or any("+cpu" not in name for name in torches):
            raise SystemExit(
                f"images: the wheelhouse needs the CPU torch wheel only, found {torches}: pass "
                "--torch-index https://download.pytorch.org/whl/cpu (or TORCH_INDEX to make)"
            )
        (cached / ".complete").write_text(wanted)
    shutil.rmtree(WHEELS, ignore_errors=True)  # exactly these wheels: they name the content tag
    WHEELS.mkdir(parents=True)
    for wheel in cached.glob("*.whl"):
        try:
            os.link(wheel, WHEELS / wheel.name)
        except OSError:  # another filesystem
            shutil.copy2(wheel, WHEELS / wheel.name)
    stamp.write_text(wanted)


def _files(service: str) -> list[Path]:
    """What a service's image is built from (tracked or new files, git's ignores applied)."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "--", "packages/lorafleet",
         f"services/{service}", "requirements.txt", "requirements-gpu.txt", ".dockerignore"],
        cwd=REPO, capture_output=True, text=True, check=True,
    ).stdout.split()  # fmt: skip
    return sorted(REPO / p for p in listed if "/tests/" not in p and (REPO / p).is_file())


def content_tag(service: str, base_id: str, flavor: str) -> str:
    digest = hashlib.sha256(f"{base_id}\n{flavor}\n".encode())
    for path in _files(service):
        digest.update(f"{path.relative_to(REPO)}\n".encode() + path.read_bytes())
    for wheel in sorted(WHEELS.glob("*.whl")):
        digest.update(wheel.name.encode())
    return "content-" + digest.hexdigest()[:16]


def _revision() -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                         text=True, check=False)  # fmt: skip
    return out.stdout.strip() or "unknown"


def build(
    services: tuple[str, ...], kind: str, base: str, gpu: bool = False
) -> list[dict[str, Any]]:
    """Build (or reuse) each service's image; tag it as the chart expects and by content."""
    wanted = refs(gpu=gpu)
    base_id = image_id(kind, base) or base
    flavor = "gpu" if gpu else "cpu"
    report = []
    for service in services:
        ref = wanted[service]
        repository = ref.rsplit(":", 1)[0]
        content = f"{repository}:{content_tag(service, base_id, flavor)}"
        started = time.monotonic()
        reused = image_id(kind, content) is not None
        if not reused:
            arguments = [
                "--build-arg", f"BASE={base}",
                "--build-arg", f"VERSION={chart_version()}",
                "--build-arg", f"REVISION={_revision()}",
                "-f", f"services/{service}/Containerfile", "-t", content,
            ]  # fmt: skip
            if service in TORCH_SERVICES:  # only they take FLAVOR
                arguments += ["--build-arg", f"FLAVOR={flavor}"]
            if kind == "buildah":
                command = [*BUILDAH, "bud", "--isolation", "chroot", "--layers", *arguments, "."]
            else:
                command = ["docker", "build", *arguments, "."]
            subprocess.run(command, cwd=REPO, check=True, stdout=sys.stderr)  # JSON owns stdout
        subprocess.run([*_tool(kind), "tag", content, ref], check=True, stdout=sys.stderr)
        report.append({
            "service": service, "image": ref, "content_tag": content, "reused": reused,
            "seconds": round(time.monotonic() - started, 1), "bytes": image_size(kind, ref),
        })  # fmt: skip
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("refs", help="print the image references, one a line").add_argument(
        "--gpu", action="store_true"
    )
    sub.add_parser("base", help="bootstrap the local Debian 12 base image if missing")
    wheels = sub.add_parser("wheels", help="fill the wheelhouse")
    wheels.add_argument("--torch-index", default=os.environ.get("TORCH_INDEX") or None)
    builder = sub.add_parser("build", help="build (or reuse) the images, print a JSON report")
    builder.add_argument("services", nargs="*", default=list(SERVICES))
    builder.add_argument(
        "--base", default=os.environ.get("IMAGE_BASE") or None,
        help="base image (default: public on docker, local Debian on buildah)",
    )  # fmt: skip
    builder.add_argument("--gpu", action="store_true", help="the GPU flavour of trainer, rollout")
    builder.add_argument("--torch-index", default=os.environ.get("TORCH_INDEX") or None)
    args = parser.parse_args(argv)
    if args.command == "refs":
        print("\n".join(refs(gpu=args.gpu).values()))
        return
    if args.command == "wheels":
        fill_wheels(args.torch_index)
        return
    kind = engine()
    if args.command == "base":
        print(ensure_base(kind))
        return
    unknown = set(args.services) - set(TORCH_SERVICES if args.gpu else SERVICES)
    if unknown:
        raise SystemExit(f"images: no such image {sorted(unknown)} (of {list(SERVICES)})")
    base = args.base or (PUBLIC_BASE if kind == "docker" else ensure_base(kind))
    started = time.monotonic()
    fill_wheels(args.torch_index)
    report = build(tuple(args.services), kind, base, gpu=args.gpu)
    print(json.dumps({"engine": kind, "base": base, "images": report,
                      "seconds": round(time.monotonic() - started, 1)}, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()

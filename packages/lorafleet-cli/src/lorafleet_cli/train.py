"""`lorafleet train qa|qa-file|file` and `lorafleet jobs list|show|cancel`: managed jobs.

Talks to the gateway's /v1/lora routes with the same two variables the SDK uses
(TINKER_BASE_URL, TINKER_API_KEY; `eval "$(lorafleet up --detach)"` sets them). A training
command creates its job without waiting, follows its server-sent events with a tqdm
progress bar (pass, loss, learning rate), then prints the result with juno's field names
and saves the loss curve: a PNG when matplotlib is installed, otherwise a CSV (matplotlib
is not one of our dependencies).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx

RESULT_FIELDS = (
    "pairCount",
    "documentCount",
    "unitCount",
    "chunkCount",
    "finalTrainLoss",
    "passCount",
    "optimizerUpdateCount",
    "stopReason",
    "targetReached",
    "bestValidationLoss",
    "bestPass",
    "lossGuidance",
    "chatTemplate",
    "checkpoint",
)


class CliError(RuntimeError):
    """One line for the user."""


def _client() -> httpx.Client:
    url, key = os.environ.get("TINKER_BASE_URL", ""), os.environ.get("TINKER_API_KEY", "")
    if not url or not key:
        raise CliError('set TINKER_BASE_URL and TINKER_API_KEY (eval "$(lorafleet up --detach)")')
    return httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=httpx.Timeout(60.0))


def _check(reply: httpx.Response) -> Any:
    if reply.status_code != 200:
        try:
            body = reply.json()
            detail = body.get("detail", reply.text)
        except ValueError:
            detail = reply.text
        raise CliError(f"HTTP {reply.status_code}: {detail}")
    return reply.json()


def _params(pairs: list[str]) -> dict[str, str]:
    out = {}
    for item in pairs:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise CliError(f"--param takes name=value, got {item!r}")
        out[name] = value
    return out


def _follow(c: httpx.Client, job: dict[str, Any]) -> dict[str, Any]:
    """Show the job's progress until it ends; the finished job."""
    from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no type stubs

    bar = tqdm(
        total=job.get("maxUpdates") or None, unit="update", file=sys.stderr, desc=job["jobId"]
    )
    event = ""
    final = job
    with c.stream("GET", f"/v1/lora/jobs/{job['jobId']}/events", timeout=None) as stream:
        for line in stream.iter_lines():
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                if event == "step":
                    bar.update(data["step"] - bar.n)
                    bar.set_postfix(
                        pass_=data["pass"], loss=f"{data['loss']:.4f}", lr=f"{data['lr']:.2e}"
                    )
                elif event == "pass" and data.get("validationLoss") is not None:
                    bar.write(
                        f"pass {data['pass']}: train {data['trainLoss']:.4f}, "
                        f"validation {data['validationLoss']:.4f}"
                    )
                elif event == "end":
                    final = data
    bar.close()
    return final


def save_curve(job: dict[str, Any], stem: Path) -> Path:
    """The loss per optimizer update: `<stem>.png` with matplotlib, else `<stem>.csv`."""
    points = job.get("curve", [])
    try:
        import matplotlib  # type: ignore[import-not-found]  # optional, not a dependency

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found]  # optional
    except ImportError:
        path = stem.with_suffix(".csv")
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["update", "pass", "loss", "learning_rate"])
            for p in points:
                writer.writerow([p["update"], p["passNumber"], p["loss"], p["learningRate"]])
        return path
    path = stem.with_suffix(".png")
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([p["update"] for p in points], [p["loss"] for p in points])
    ax.set_xlabel("optimizer update")
    ax.set_ylabel("training loss")
    ax.set_title(job["jobId"])
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _print_result(job: dict[str, Any]) -> None:
    print(f"job {job['jobId']} {job['state']} (run {job['runId']})")
    if job.get("error"):
        print(f"error: {job['error'].get('field') or ''} {job['error']['message']}".strip())
    for name in RESULT_FIELDS:
        if job.get(name) not in (None, ""):
            print(f"  {name}: {job[name]}")


def cmd_train(args: argparse.Namespace) -> int:
    query = {**_params(args.param), "wait": "false"}
    if args.run:
        query["run"] = args.run
    with _client() as c:
        if args.kind == "qa":
            if len(args.inputs) != 2:
                raise CliError('train qa takes a question and an answer: qa "Q?" "A"')
            reply = c.post(
                "/v1/lora/train-qa", params=query, json={"Q": args.inputs[0], "A": args.inputs[1]}
            )
        else:
            if len(args.inputs) != 1:
                raise CliError(f"train {args.kind} takes one file")
            path = Path(args.inputs[0])
            if not path.is_file():
                raise CliError(f"no file {path}")
            route = "train-file-qa" if args.kind == "qa-file" else "train-file"
            ctype = "application/json" if args.kind == "qa-file" else "text/plain"
            files = {"file": (path.name, path.read_bytes(), ctype)}
            reply = c.post(f"/v1/lora/{route}", params=query, files=files)
        job = _follow(c, _check(reply))
    _print_result(job)
    if job.get("curve"):
        stem = Path(args.curve) if args.curve else Path(f"{job['jobId']}-loss")
        print(f"  loss curve: {save_curve(job, stem.with_suffix(''))}")
    return 0 if job["state"] == "succeeded" else 1


def cmd_jobs(args: argparse.Namespace) -> int:
    with _client() as c:
        if args.action == "list":
            for job in _check(c.get("/v1/lora/jobs", params={"limit": args.limit}))["jobs"]:
                loss = job.get("finalTrainLoss", job.get("trainLoss"))
                shown = "-" if loss is None else f"{loss:.4f}"
                print(
                    f"{job['jobId']}  {job['kind']:<5} {job['state']:<10} "
                    f"updates {job['updates']:>5}  loss {shown}  {job['runId']}"
                )
            return 0
        if not args.job_id:
            raise CliError(f"jobs {args.action} needs a job id")
        if args.action == "show":
            _print_result(_check(c.get(f"/v1/lora/jobs/{args.job_id}")))
        else:
            job = _check(c.post(f"/v1/lora/jobs/{args.job_id}/cancel"))
            print(f"job {job['jobId']}: cancellation requested ({job['state']})")
    return 0


def _run(fn: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        try:
            return int(fn(args))
        except (CliError, httpx.HTTPError) as exc:
            print(f"lorafleet: {exc}", file=sys.stderr)
            return 1

    return run


def add_parsers(sub: Any) -> None:
    """`train` and `jobs` subcommands on the `lorafleet` parser."""
    train = sub.add_parser("train", help="managed training jobs: qa | qa-file | file")
    train.add_argument("kind", choices=("qa", "qa-file", "file"))
    train.add_argument("inputs", nargs="+", help='qa: "QUESTION" "ANSWER"; qa-file, file: PATH')
    train.add_argument(
        "--param",
        "-p",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="job parameter (learning_rate, loss_target, max_iters, ...)",
    )
    train.add_argument("--run", default="", help="training run (default: your default run)")
    train.add_argument("--curve", default="", help="loss curve file stem (default: <job>-loss)")
    train.set_defaults(fn=_run(cmd_train))

    jobs = sub.add_parser("jobs", help="managed training jobs: list | show | cancel")
    jobs.add_argument("action", choices=("list", "show", "cancel"))
    jobs.add_argument("job_id", nargs="?", default="")
    jobs.add_argument("--limit", type=int, default=20)
    jobs.set_defaults(fn=_run(cmd_jobs))

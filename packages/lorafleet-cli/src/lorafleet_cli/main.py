"""`lorafleet`: bring the fleet up and down, inspect it, manage API keys and local models.

`lorafleet up` prints exactly two lines on stdout, for `eval "$(lorafleet up --detach)"`:
`export TINKER_BASE_URL=...` and `export TINKER_API_KEY=...`; everything else goes to
stderr. Errors are one line and a non-zero exit, with everything already started stopped.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from lorafleet import quantize
from lorafleet.tls import TlsIdentity
from lorafleet_cli import accounting, runs, train
from lorafleet_cli.fleet import Fleet, FleetConfig, FleetError
from lorafleet_cli.models import check_engine_serves, resolve_model


def _err(message: str) -> None:
    print(f"lorafleet: {message}", file=sys.stderr)


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _redis_answers(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=2).ping())
    except (redis.RedisError, ValueError, OSError):
        return False


def _exports(base_url: str, api_key: str) -> str:
    return f"export TINKER_BASE_URL={base_url}\nexport TINKER_API_KEY={api_key}"


def cmd_up(args: argparse.Namespace) -> int:
    for name in ("trainers", "rollouts", "slots"):
        if getattr(args, name) < 1:
            _err(f"--{name} must be at least 1")
            return 1
    if args.port and not _port_free("127.0.0.1", args.port):
        _err(f"port {args.port} is already in use (pick another with --port)")
        return 1
    if args.redis_url and not _redis_answers(args.redis_url):
        _err(f"Redis at {args.redis_url} does not answer")
        return 1
    if args.detach:
        return _up_detached(args)
    try:
        model = resolve_model(args.model)
        check_engine_serves(model, args.engine)
    except FleetError as exc:
        _err(str(exc))
        return 1
    run_dir = Path(args.run_dir) if args.run_dir else runs.new_run_dir()
    config = FleetConfig(
        model_path=model,
        run_dir=run_dir,
        trainers=args.trainers,
        rollouts=args.rollouts,
        slots=args.slots,
        gateway_port=args.port,
        redis_url=args.redis_url,
        engine=args.engine,
        sglang_python=Path(args.sglang_python) if args.sglang_python else None,
        quantization=args.quantization,
    )
    fleet = Fleet(config)
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    print(f"lorafleet: starting the fleet (logs in {run_dir / 'logs'})", file=sys.stderr)
    try:
        fleet.start()
    except FleetError as exc:
        _err(str(exc))
        return 1
    runs.set_current(run_dir)
    print(_exports(fleet.base_url, fleet.api_key), flush=True)
    print("lorafleet: fleet is up; Ctrl-C (or `lorafleet down`) stops it", file=sys.stderr)
    try:
        while not stop["now"]:  # a failed process stays down; the supervisor logged it
            time.sleep(0.5)
    finally:
        fleet.stop()
        runs.clear_current(run_dir)
        print("lorafleet: fleet stopped", file=sys.stderr)
    return 1 if fleet.failures else 0


def _up_detached(args: argparse.Namespace) -> int:
    """Run `lorafleet up` (foreground mode) as a daemon; return once it printed its exports."""
    run_dir = Path(args.run_dir) if args.run_dir else runs.new_run_dir()
    argv = [
        sys.executable,
        "-m",
        "lorafleet_cli.main",
        "up",
        "--run-dir",
        str(run_dir),
        "--model",
        args.model,
        "--trainers",
        str(args.trainers),
        "--rollouts",
        str(args.rollouts),
        "--slots",
        str(args.slots),
    ]
    if args.port:
        argv += ["--port", str(args.port)]
    if args.redis_url:
        argv += ["--redis-url", args.redis_url]
    argv += ["--engine", args.engine, "--quantization", args.quantization]
    if args.sglang_python:
        argv += ["--sglang-python", args.sglang_python]
    run_dir.mkdir(parents=True, exist_ok=True)
    out_path, log_path = run_dir / "up.out", run_dir / "up.log"
    # up.out holds the API key: owner-only from the first byte.
    out_fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(out_fd, "wb") as out, open(log_path, "ab") as log:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True
        )
    while True:
        text = out_path.read_text()
        if text.count("\n") >= 2:
            print(text.strip(), flush=True)
            return 0
        if proc.poll() is not None:
            lines = [ln for ln in log_path.read_text().splitlines() if ln.startswith("lorafleet:")]
            _err(lines[-1].removeprefix("lorafleet: ") if lines else f"exited {proc.returncode}")
            return 1
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cmd_down(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir) if args.run_dir else runs.current()
    state = runs.read_state(run_dir) if run_dir else None
    if run_dir is None or state is None:
        print("lorafleet: nothing running", file=sys.stderr)
        return 0
    launcher = state.get("launcher_pid")
    if launcher and _alive(launcher) and runs.is_ours(launcher):
        os.kill(launcher, signal.SIGTERM)
        deadline = time.monotonic() + 60
        while _alive(launcher) and time.monotonic() < deadline:
            time.sleep(0.2)
    # Anything the launcher did not stop (it was killed, say): stop by recorded PID.
    for entry in reversed(state["processes"]):
        pid = entry["pid"]
        if _alive(pid) and runs.is_ours(pid):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    for entry in state["processes"]:
        while _alive(entry["pid"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(entry["pid"]) and runs.is_ours(entry["pid"]):
            os.kill(entry["pid"], signal.SIGKILL)
    runs.clear_current(run_dir)
    (run_dir / "fleet.json").unlink(missing_ok=True)
    print("lorafleet: fleet stopped", file=sys.stderr)
    return 0


def _controller(args: argparse.Namespace) -> tuple[str, TlsIdentity | None]:
    """The controller to ask, and the admin identity to ask with: --controller and
    LORAFLEET_TLS_*, or the current run's address and admin certificate."""
    if getattr(args, "controller", None):
        return str(args.controller), None
    run_dir = runs.current()
    state = runs.read_state(run_dir) if run_dir else None
    if state is None:
        raise FleetError("no running fleet (start one with `lorafleet up`, or pass --controller)")
    return str(state["controller_address"]), runs.admin_identity(state)


def cmd_status(args: argparse.Namespace) -> int:
    from lorafleet_cli.status import render_status

    state = None if args.controller else runs.read_state(runs.current())
    try:
        address, tls = _controller(args)
    except FleetError as exc:
        _err(str(exc))
        return 1
    text, problem = render_status(address, tls, state)
    print(text)
    if problem:
        _err(problem)
        return 1
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    from lorafleet_cli import keys

    try:
        return keys.run(args, *_controller(args))
    except FleetError as exc:
        _err(str(exc))
        return 1


def cmd_models(args: argparse.Namespace) -> int:
    from lorafleet_models.cli import main as models_main

    return int(models_main(["models", *args.rest]) or 0)


def cmd_demo(args: argparse.Namespace) -> int:
    from lorafleet_cli.demo import run_demo

    return run_demo(args.model)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lorafleet", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start Redis, controller, trainers, rollouts and gateway")
    up.add_argument("--model", default="tiny", help="tiny | bench | smollm2 | PATH")
    up.add_argument("--trainers", type=int, default=1)
    up.add_argument("--rollouts", type=int, default=1)
    up.add_argument("--slots", type=int, default=8)
    up.add_argument("--port", type=int, default=0, help="gateway port (default: a free one)")
    up.add_argument("--redis-url", default="", help="use this Redis instead of a private one")
    up.add_argument("--detach", action="store_true", help="run in the background")
    up.add_argument(
        "--engine",
        choices=("torch", "sglang"),
        default="torch",
        help="rollout engine: torch (in process) or sglang (a real SGLang server "
        "beside each rollout: CUDA where nvidia-smi is, else its CPU backend)",
    )
    up.add_argument(
        "--sglang-python",
        default="",
        help="interpreter with SGLang installed (default: .venvs/sglang, made by "
        "services/rollout/tests/setup_sglang_venv.sh)",
    )
    up.add_argument(
        "--quantization",
        choices=quantize.QUANTIZATIONS,
        default=quantize.NONE,
        help="how trainers and rollouts store the frozen base: int8 (weight-only, per-row "
        "scales) or fp8 (e4m3, per matrix; SGLang's --quantization fp8); none by default",
    )
    up.add_argument("--run-dir", default="", help="run folder (default: a new one)")
    up.set_defaults(fn=cmd_up)

    down = sub.add_parser("down", help="stop what `lorafleet up` started")
    down.add_argument("--run-dir", default="")
    down.set_defaults(fn=cmd_down)

    status = sub.add_parser("status", help="health, slots, queues and adapters")
    status.add_argument("--controller", default="")
    status.set_defaults(fn=cmd_status)

    keys = sub.add_parser("keys", help="API keys: create | list | revoke")
    keys.add_argument("action", choices=("create", "list", "revoke"))
    keys.add_argument(
        "target", nargs="?", default="", help="tenant (create, list) or key id (revoke)"
    )
    keys.add_argument("--label", default="")
    keys.add_argument("--controller", default="")
    keys.set_defaults(fn=cmd_keys)

    models = sub.add_parser("models", help="local models: build | import | list")
    models.add_argument("rest", nargs=argparse.REMAINDER)
    models.set_defaults(fn=cmd_models)

    demo = sub.add_parser("demo", help="the README's first command: up + quickstart + down")
    demo.add_argument("--model", default="smollm2")
    demo.set_defaults(fn=cmd_demo)
    accounting.add_parsers(sub, _controller)  # adapters import, usage, page-out
    train.add_parsers(sub)  # train, jobs: managed training jobs (issue 13)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.fn(args))


if __name__ == "__main__":
    sys.exit(main())

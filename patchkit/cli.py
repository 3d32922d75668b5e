"""The `patchkit` command: `patchkit serve FILE.py` serves the pipeline a script captures, `patchkit
plan FILE.py` prints the plan the offline planner makes for it, `patchkit demo` deploys the
CRAG example on real components and asks it questions, and `patchkit bench URL` sends load
to an endpoint and reports its latency, throughput and SLO attainment."""

from __future__ import annotations

import argparse
import json
import logging
import runpy
import secrets
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from patchkit.client.pipeline import Pipeline
    from patchkit.scheduler.offline.plan import Plan

__all__ = ["main"]

LOG_LEVELS = ("debug", "info", "warning", "error")


def _load(command: str, file: str) -> Pipeline | None:
    """Run the script as an imported module would, as `uvicorn module:app` runs one (its `if __name__ ==
    "__main__":` block does not run), and return its last capture; None after printing why not."""
    import patchkit

    script = Path(file).resolve()
    if not script.is_file():
        print(f"patchkit {command}: no such file: {file}", file=sys.stderr)
        return None
    sys.argv = [str(script)]
    sys.path.insert(0, str(script.parent))
    runpy.run_path(str(script), run_name="__patchkit_serve__")
    try:
        return patchkit.last_pipeline()
    except patchkit.PatchkitError:
        print(
            f"patchkit {command}: {file} ran no `with patchkit.capture():` block; capture at module level "
            "(a block under `if __name__ == '__main__':` does not run here)",
            file=sys.stderr,
        )
        return None


def _plan_file(args: argparse.Namespace) -> Plan | str | None:
    """`--plan auto` as it is (planned once the arguments are checked); `--plan FILE.json`, what `patchkit plan
    --json` printed, loaded."""
    from patchkit.errors import ConfigError
    from patchkit.scheduler.offline.plan import Plan

    if args.plan is None or args.plan == "auto":
        return args.plan
    try:
        data = json.loads(Path(args.plan).read_text())
    except OSError as exc:
        raise ConfigError(f"--plan names {args.plan!r}, which cannot be read ({exc.strerror}); pass 'auto' or a "
                          "file `patchkit plan --json` wrote") from None
    except ValueError as exc:
        raise ConfigError(f"--plan names {args.plan!r}, which is not JSON ({exc}); pass a file `patchkit plan --json` "
                          "wrote") from None
    return Plan.from_dict(data)


def _resources(args: argparse.Namespace) -> dict[str, int] | None:
    from patchkit.scheduler.offline.pool import ResourcePool

    return dict(ResourcePool.parse(args.resources).capacity) if args.resources else None


def _serve(args: argparse.Namespace) -> int:
    from patchkit.config import DeploymentConfig
    from patchkit.scheduler.offline.planner import plan
    from patchkit.server.process import serve_blocking

    options = {
        "backend": args.backend, "host": args.host, "port": args.port, "slo_ms": args.slo_ms,
        "batch_wait_ms": args.batch_wait_ms, "log_level": args.log_level,
    }
    DeploymentConfig.check_options(options)  # before the script runs: it may take a while
    pipeline = _load("serve", args.file)
    if pipeline is None:
        return 2
    chosen = _plan_file(args)
    DeploymentConfig.check_arguments(pipeline, replicas=args.replicas, batch_size=args.batch_size, plan=chosen, **options)
    if chosen == "auto":
        chosen = plan(pipeline, resources=_resources(args), slo_ms=args.slo_ms)
    config = DeploymentConfig.resolve(
        pipeline, replicas=args.replicas, batch_size=args.batch_size, plan=chosen, secret=secrets.token_urlsafe(32), **options
    )
    script = Path(args.file)

    def ready(url: str) -> None:
        print(f"patchkit: serving {script.name} at {url} (Ctrl-C stops)", flush=True)

    serve_blocking(pipeline, config, ready)
    print("patchkit: stopped", flush=True)
    return 0


def _plan(args: argparse.Namespace) -> int:
    from patchkit.scheduler.offline.planner import plan

    pipeline = _load("plan", args.file)
    if pipeline is None:
        return 2
    made = plan(pipeline, resources=_resources(args), slo_ms=args.slo_ms)
    print(json.dumps(made.to_dict(), indent=2) if args.json else made.table(), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="patchkit", description="Serve RAG pipelines written in plain Python.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run a script's capture and serve its pipeline until Ctrl-C")
    serve.add_argument("file", help="a Python script with a `with patchkit.capture():` block")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--backend", default="local", choices=["local", "inprocess", "ray"])
    serve.add_argument("--replicas", type=int, default=None, help="replicas of every component (default 1)")
    serve.add_argument("--batch-size", type=int, default=None, help="batch size of every method (default: the method's own)")
    serve.add_argument("--batch-wait-ms", type=float, default=0.0, help="how long a partial batch waits for more calls")
    serve.add_argument("--slo-ms", type=float, default=None, help="the latency target of every request")
    serve.add_argument("--plan", default=None, help="'auto' to plan first, or a plan saved by `patchkit plan --json`")
    serve.add_argument("--resources", default=None, help="with --plan auto: the pool, as cpu=5,gpu=2 (default: this machine)")
    serve.add_argument("--log-level", type=str.lower, default="info", choices=LOG_LEVELS,
                       help="what the server, its front-end and its workers log (default: info)")
    planner = commands.add_parser("plan", help="profile a script's pipeline and print the plan that maximises its throughput")
    planner.add_argument("file", help="a Python script with a `with patchkit.capture():` block that runs eagerly")
    planner.add_argument("--resources", default=None, help="the pool, as cpu=5,gpu=2 (default: this machine)")
    planner.add_argument("--slo-ms", type=float, default=None, help="plan only batch sizes whose latency fits this target")
    planner.add_argument("--json", action="store_true", help="print the plan as JSON (for `patchkit serve --plan FILE`)")
    demo = commands.add_parser("demo", help="deploy the CRAG example (pydoc corpus, SmolLM2) and ask it questions")
    demo.add_argument("questions", nargs="*", help="questions to ask instead of the built-in ones")
    demo.add_argument("--replicas", type=int, default=None, help="replicas of every component (default 1)")
    from patchkit.bench import add_arguments as add_bench_arguments

    bench = commands.add_parser(
        "bench", help="send load to an endpoint (open loop, or a closed loop); report latency, throughput, SLO attainment"
    )
    add_bench_arguments(bench)
    args = parser.parse_args(argv)
    level = getattr(args, "log_level", "info").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from patchkit.errors import PatchkitError

    try:  # every error patchkit raises on purpose is one line and exit status 2; a traceback is a bug
        if args.command == "serve":
            return _serve(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "bench":
            from patchkit.bench import run_from_args

            return run_from_args(args)
        from patchkit.demo import main as demo_main

        return demo_main(args.questions, replicas=args.replicas)
    except PatchkitError as exc:  # a mistake the user can fix: its message, not a traceback
        print(f"patchkit {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

"""The `patchkit` command: `patchkit serve FILE.py|module:attribute [--config deploy.yaml]` serves the pipeline
a script captures (or a module holds), with options from a config file (config/file.py) and flags, `patchkit
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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from patchkit.client.pipeline import Pipeline
    from patchkit.scheduler.offline.plan import Plan

__all__ = ["main", "parser", "serve_settings"]

def _load(command: str, target: str) -> Pipeline | None:
    """The pipeline a `FILE.py` script's last capture made, or the one `module:attribute` names; None after
    printing why not. Raises ConfigError for a module or attribute that is not there."""
    if ":" in target and not target.endswith(".py") and not Path(target).is_file():
        return _import(target)
    return _run_script(command, target)


def _run_script(command: str, file: str) -> Pipeline | None:
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


def _import(target: str) -> Pipeline:
    """`module:attribute` (dotted on both sides), imported from the working directory first, as Ray Serve's
    `serve run module:app` does; the attribute must be a Pipeline."""
    import difflib
    import importlib

    from patchkit.client.pipeline import Pipeline
    from patchkit.errors import ConfigError

    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"name a pipeline as module:attribute, such as app:pipeline; got {target!r}")
    sys.path.insert(0, str(Path.cwd()))
    try:
        found: object = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise  # the module is there; something it imports is not
        raise ConfigError(f"no module named {module_name!r} (looked in {Path.cwd()} and sys.path)") from None
    path = module_name
    for part in attribute.split("."):
        if not hasattr(found, part):
            close = difflib.get_close_matches(part, [n for n in dir(found) if not n.startswith("_")], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{path} has no attribute {part!r}{hint}")
        found, path = getattr(found, part), f"{path}.{part}"
    if not isinstance(found, Pipeline):
        raise ConfigError(f"{target} is a {type(found).__name__}, not a Pipeline: name the object "
                          "`with patchkit.capture() as pipeline:` makes")
    return found


def _plan_file(given: str | None, source: str) -> Plan | str | None:
    """'auto' as it is (planned once the arguments are checked); a file, what `patchkit plan --json` printed, loaded."""
    from patchkit.errors import ConfigError
    from patchkit.scheduler.offline.plan import Plan

    if given is None or given == "auto":
        return given
    try:
        data = json.loads(Path(given).read_text())
    except OSError as exc:
        raise ConfigError(f"{source} names {given!r}, which cannot be read ({exc.strerror}); pass 'auto' or a "
                          "file `patchkit plan --json` wrote") from None
    except ValueError as exc:
        raise ConfigError(f"{source} names {given!r}, which is not JSON ({exc}); pass a file `patchkit plan --json` "
                          "wrote") from None
    return Plan.from_dict(data)


def _resources(text: str | None) -> dict[str, int] | None:
    from patchkit.scheduler.offline.pool import ResourcePool

    return dict(ResourcePool.parse(text).capacity) if text else None


# The deploy options `patchkit serve` takes as flags (each made from the option's metadata), then all its flags;
# a flag overrides the config file's key of the same name.
OPTION_FLAGS = ("host", "port", "backend", "batch_wait_ms", "slo_ms", "log_level")
SERVE_FLAGS = (*OPTION_FLAGS, "replicas", "batch_size", "plan")


def _option_flag(command: argparse.ArgumentParser, name: str) -> None:
    """A deploy option's flag: its type, choices and help from the option's metadata, its default `patchkit
    serve`'s (None: the file's key, else that default, applies)."""
    from patchkit.config import OPTIONS
    from patchkit.config.file import SERVE_DEFAULTS
    from patchkit.config.options import simple_type

    spec = OPTIONS[name]
    kind, choices = simple_type(spec), spec.option.choices or None
    default = SERVE_DEFAULTS.get(name, spec.default)
    shown = "" if default is None else f" (default {default})"
    command.add_argument(f"--{name.replace('_', '-')}", default=None, choices=choices, help=f"{spec.option.help}{shown}",
                         type=str.lower if spec.option.any_case else kind)


def serve_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The config file's keys (if any) with the flags given on the command line over them. A --replicas or
    --batch-size flag sets every component's, so it also overrides the file's per-component ones."""
    from patchkit.config import file as config_file

    values = config_file.given(config_file.load(args.config) if args.config else config_file.ServeFile.model_validate({}))
    flags = {name: getattr(args, name) for name in SERVE_FLAGS if getattr(args, name) is not None}
    if args.resources is not None:
        flags["resources"] = _resources(args.resources)
    values.update(flags)
    for name in ("replicas", "batch_size"):
        if name in flags:
            values["components"] = {c: {**o, name: None} for c, o in values.get("components", {}).items()}
    return values


def _serve(args: argparse.Namespace) -> int:
    from patchkit.config import DeploymentConfig
    from patchkit.config import file as config_file
    from patchkit.scheduler.offline.planner import plan
    from patchkit.server.process import FrontendServer, serve_blocking

    values = serve_settings(args)
    options = {k: v for k, v in values.items() if k not in config_file.FILE_ONLY}
    DeploymentConfig.check_options(options)  # before the pipeline loads: a script may take a while
    logging.getLogger().setLevel((options.get("log_level") or "info").upper())
    pipeline = _load("serve", args.target)
    if pipeline is None:
        return 2
    arguments = config_file.deploy_arguments(values, pipeline.components)
    chosen = arguments["plan"] = _plan_file(values.get("plan"), "--plan" if args.plan is not None else "plan")
    DeploymentConfig.check_arguments(pipeline, **arguments)
    if chosen == "auto":
        arguments["plan"] = plan(pipeline, resources=values.get("resources"), slo_ms=values.get("slo_ms"))
    config = DeploymentConfig.resolve(pipeline, secret=secrets.token_urlsafe(32), **arguments)
    shown = Path(args.target).name if args.target.endswith(".py") else args.target

    def ready(server: FrontendServer) -> None:
        print(f"patchkit: serving {shown} at {server.url} (Ctrl-C stops)", flush=True)

    serve_blocking(pipeline, config, ready)
    print("patchkit: stopped", flush=True)
    return 0


def _plan(args: argparse.Namespace) -> int:
    from patchkit.scheduler.offline.planner import plan

    pipeline = _load("plan", args.target)
    if pipeline is None:
        return 2
    made = plan(pipeline, resources=_resources(args.resources), slo_ms=args.slo_ms)
    print(json.dumps(made.to_dict(), indent=2) if args.json else made.table(), flush=True)
    return 0


def parser() -> argparse.ArgumentParser:
    """Every command's arguments; `patchkit serve --help` lists the config file's keys."""
    root = argparse.ArgumentParser(prog="patchkit", description="Serve RAG pipelines written in plain Python.")
    commands = root.add_subparsers(dest="command", required=True)
    from patchkit.config.file import describe as describe_config_file

    serve = commands.add_parser(
        "serve", help="serve a pipeline (a script's capture, or module:attribute) until Ctrl-C",
        epilog=describe_config_file(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument("target", metavar="FILE.py|module:attribute",
                       help="a Python script with a `with patchkit.capture():` block, or a module's Pipeline object")
    serve.add_argument("--config", default=None, metavar="FILE", help="deploy options from a YAML, JSON or TOML file (below)")
    for name in OPTION_FLAGS:
        _option_flag(serve, name)
    serve.add_argument("--replicas", type=int, default=None, help="replicas of every component (default 1)")
    serve.add_argument("--batch-size", type=int, default=None, help="batch size of every method (default: the method's own)")
    serve.add_argument("--plan", default=None, help="'auto' to plan first, or a plan saved by `patchkit plan --json`")
    serve.add_argument("--resources", default=None, help="with --plan auto: the pool, as cpu=5,gpu=2 (default: this machine)")
    planner = commands.add_parser("plan", help="profile a script's pipeline and print the plan that maximises its throughput")
    planner.add_argument("target", metavar="FILE.py|module:attribute",
                         help="a Python script with a `with patchkit.capture():` block that runs eagerly, or a Pipeline object")
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
    return root


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    quiet = "warning" if args.command == "demo" else "info"  # the demo shows its answers and table, not the workers' loading
    level = (getattr(args, "log_level", None) or quiet).upper()
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
    except PatchkitError as exc:  # a mistake the user can fix: its message (a line per problem), not a traceback
        for line in str(exc).splitlines():
            print(f"patchkit {args.command}: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

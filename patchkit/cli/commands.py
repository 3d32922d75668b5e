"""The `patchkit` command's parser and its commands: serve, mcp, plan, demo, bench and doctor (see `patchkit.cli`)."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import secrets
import sys
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from patchkit.cli.targets import Target, load_pipeline, serve_targets, source_file

if TYPE_CHECKING:
    from patchkit.config import DeploymentConfig
    from patchkit.program.pipeline import Pipeline
    from patchkit.reload import Reloader
    from patchkit.scheduler.offline.plan import Plan

__all__ = ["OPTION_FLAGS", "main", "parser", "serve_settings"]


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


def _option_flags() -> tuple[str, ...]:
    """The deploy options `patchkit serve` takes as flags: those whose metadata says `flag`."""
    from patchkit.config import OPTIONS

    return tuple(name for name, spec in OPTIONS.items() if spec.option.flag)


OPTION_FLAGS = _option_flags()


def _option_flag(command: argparse.ArgumentParser, name: str) -> None:
    """A deploy option's flag: its type, choices and help from the option's metadata, its default `patchkit
    serve`'s (None: the file's key, else that default, applies)."""
    from patchkit.config import OPTIONS
    from patchkit.config.file import SERVE_DEFAULTS
    from patchkit.config.options import simple_type

    spec = OPTIONS[name]
    kind, choices = simple_type(spec), spec.option.choices or None
    default = SERVE_DEFAULTS.get(name, spec.default)
    flag = f"--{name.replace('_', '-')}"
    if kind is bool:  # --fail-fast and --no-fail-fast
        help_text = f"{spec.option.help} (default {'on' if default else 'off'})"
        command.add_argument(flag, default=None, action=argparse.BooleanOptionalAction, help=help_text)
        return
    shown = "" if default is None else f" (default {default})"
    command.add_argument(flag, default=None, choices=choices, help=f"{spec.option.help}{shown}",
                         type=str.lower if spec.option.any_case else kind)


def _file_flag(command: argparse.ArgumentParser, name: str, kind: type) -> None:
    """A flag for a config-file key that is no deploy option (`--replicas`): its help the key's."""
    from patchkit.config.file import ServeFile

    command.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None, help=ServeFile.model_fields[name].description)


def serve_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The config file's keys (if any) with the flags given on the command line over them. A --replicas or
    --batch-size flag sets every component's, so it also overrides the file's per-component ones; --slo-ms
    every pipeline's, so it overrides the file's per-pipeline ones."""
    from patchkit.config import file as config_file

    values = config_file.given(config_file.load(args.config) if args.config else config_file.ServeFile.model_validate({}))
    # A flag given overrides the config file's key of the same name.
    keys = config_file.ServeFile.model_fields
    flags = {name: value for name, value in vars(args).items() if name in keys and value is not None}
    if "resources" in flags:
        flags["resources"] = _resources(flags["resources"])
    values.update(flags)
    for name in ("replicas", "batch_size"):
        if name in flags:
            values["components"] = {c: {**o, name: None} for c, o in values.get("components", {}).items()}
    for name in set(config_file.PER_PIPELINE) & set(flags):
        values["pipelines"] = {p: {**o, name: None} for p, o in values.get("pipelines", {}).items()}
    return values


@dataclass(frozen=True)
class _Served:
    """What `patchkit serve` and `patchkit mcp` serve: the targets, their pipelines, the config, the reloader."""

    targets: list[Target]
    pipelines: Pipeline | dict[str, Pipeline]
    config: DeploymentConfig
    reloader: Reloader | None


def _load_served(args: argparse.Namespace) -> _Served:
    """The targets and options of `serve` and `mcp`, checked, the pipelines loaded and stamped, the config resolved."""
    from patchkit.config import DeploymentConfig
    from patchkit.config import file as config_file
    from patchkit.config.deployment import served_components
    from patchkit.program.pipeline import stamp
    from patchkit.scheduler.offline.planner import plan

    values = serve_settings(args)
    options = {k: v for k, v in values.items() if k not in config_file.FILE_ONLY}
    DeploymentConfig.check_options(options)  # before the pipelines load: a script may take a while
    targets = serve_targets(args.targets, values, args.config)
    logging.getLogger().setLevel((options.get("log_level") or "info").upper())
    sources = {target.name: source_file(target.where) for target in targets} if args.reload else {}
    stamps = {name: _stamp(path) for name, path in sources.items()}  # before loading: an edit while it loads is seen
    before = set(sys.modules)
    loaded = {target.name: load_pipeline(target.where) for target in targets}
    stamp(loaded)  # their versions, here where their code is: the front-end compares them
    # One target without a name is served as today, under the config's `name`; else each by its own.
    pipelines: Pipeline | dict[str, Pipeline] = loaded[targets[0].name] if not targets[0].named and len(targets) == 1 else loaded
    arguments = config_file.deploy_arguments(values, served_components(pipelines))
    chosen = arguments["plan"] = _plan_file(values.get("plan"), "--plan" if args.plan is not None else "plan")
    DeploymentConfig.check_arguments(pipelines, **arguments)
    if chosen == "auto":
        arguments["plan"] = plan(pipelines, weights=config_file.plan_weights(values), resources=values.get("resources"),
                                 slo_ms=_strictest(arguments.get("slo_ms")))
    elif config_file.plan_weights(values) is not None:
        logging.getLogger(__name__).warning("the pipelines' weights are read with plan: auto only; without it they do nothing")
    config = DeploymentConfig.resolve(pipelines, secret=secrets.token_urlsafe(32), **arguments)
    reloader = _reloader(targets, sources, stamps, None if isinstance(pipelines, Mapping) else config.chat.name, before)
    return _Served(targets, pipelines, config, reloader)


def _serve(args: argparse.Namespace) -> int:
    from patchkit.server.process import FrontendServer, serve_blocking

    served = _load_served(args)
    targets, reloader = served.targets, served.reloader

    def ready(server: FrontendServer) -> None:
        failed = {row["name"] for row in server.frontend.describe() if row["state"] == "failed"}  # each logged above
        shown = ", ".join(target.label(with_name=len(targets) > 1) + (" (failed)" if target.name in failed else "")
                          for target in targets)
        print(f"patchkit: serving {shown} at {server.url} (Ctrl-C stops)", flush=True)
        if reloader is not None:
            reloader.start(server)

    try:
        serve_blocking(served.pipelines, served.config, ready)
    finally:
        if reloader is not None:
            reloader.stop()
    print("patchkit: stopped", flush=True)
    return 0


def _mcp(args: argparse.Namespace) -> int:
    """`patchkit mcp`: `serve`'s targets and options, the tools over stdin/stdout, until the client closes stdin."""
    import asyncio

    from patchkit.server.mcp.stdio import StdioServer, divert_stdio, require_sdk

    require_sdk()  # before the targets load: they may take a while
    _refuse_listening_flags(args)
    wire = divert_stdio()  # first: whatever loads, prints or starts from here on writes to stderr
    served = _load_served(args)
    targets, reloader = served.targets, served.reloader
    log = logging.getLogger(__name__)

    def ready(server: StdioServer) -> None:
        shown = ", ".join(target.label(with_name=len(targets) > 1) for target in targets)
        log.info("serving %s as MCP tools over stdin and stdout (closing stdin stops)", shown)
        if reloader is not None:
            reloader.start(server)

    try:
        asyncio.run(StdioServer(served.pipelines, served.config, wire).serve(ready))
    finally:
        if reloader is not None:
            reloader.stop()
    log.info("stopped")
    return 0


def _refuse_listening_flags(args: argparse.Namespace) -> None:
    """`patchkit mcp` listens on no port: a --host or --port given to it is a ConfigError, never ignored."""
    from patchkit.errors import ConfigError

    given = [f"--{name}" for name in ("host", "port") if getattr(args, name, None) is not None]
    if given:
        raise ConfigError(f"patchkit mcp serves over stdin and stdout, so {' and '.join(given)} do nothing: leave "
                          "them out, or run patchkit serve, whose /mcp route serves the same tools over HTTP")


def _stamp(path: Path | None) -> tuple[int, int] | None:
    from patchkit.reload import stamp

    return None if path is None else stamp(path)


def _reloader(targets: Sequence[Target], sources: Mapping[str, Path | None], stamps: Mapping[str, tuple[int, int] | None],
              only_name: str | None, before: Collection[str]) -> Reloader | None:
    """With --reload, what watches each target's file and the user's modules their loads imported (those not in
    `before`, the modules loaded before them) (`patchkit.reload.Reloader`); None without. `only_name`: the name
    the one unnamed target is served under (the config's `name`)."""
    if not sources:
        return None
    from patchkit.reload import Reloader, Watched, imported_modules

    watched = []
    for target in targets:
        path = sources[target.name]
        if path is None:
            logging.getLogger(__name__).warning("--reload cannot watch %s: it has no file of its own", target.where)
            continue
        load = functools.partial(load_pipeline, target.where, again=True)
        watched.append(Watched(only_name or target.name, path, load, target.label(), stamps[target.name]))
    own = {path for path in sources.values() if path is not None}
    modules = {name: path for name, path in imported_modules(before).items() if path not in own}
    return Reloader(watched, modules) if watched else None


def _strictest(slo_ms: float | Mapping[str, float | None] | None) -> float | None:
    """The SLO a plan of several pipelines must meet: the tightest of theirs."""
    if isinstance(slo_ms, Mapping):
        return min((v for v in slo_ms.values() if v is not None), default=None)
    return slo_ms


def _plan(args: argparse.Namespace) -> int:
    from patchkit.scheduler.offline.planner import plan

    pipeline = load_pipeline(args.target)
    made = plan(pipeline, resources=_resources(args.resources), slo_ms=args.slo_ms)
    print(json.dumps(made.to_dict(), indent=2) if args.json else made.table(), flush=True)
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from patchkit.doctor import print_report, report, to_json

    chosen = {"model": args.model, "timeout_s": args.timeout, "crash": args.crash_check or ()}
    if not args.json:
        return 0 if print_report(args.check or None, **chosen) else 1
    made = report(args.check or None, **chosen)
    print(to_json(made), flush=True)
    return 0 if made["ok"] else 1


def _doctor_command(commands: Any) -> None:
    from patchkit.doctor import CHECKS, TIMEOUT_S

    doctor = commands.add_parser(
        "doctor", help="print what a bug report needs (Python, OS, CPU flags, memory, GPUs, versions) and check each "
                       "native part in a process of its own; exit status 1 when a check fails",
        epilog="checks:\n" + "\n".join(f"  {c.name:<10} {c.what}" + (f" [{c.extra}]" if c.extra else "") for c in CHECKS),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor.add_argument("--check", action="append", choices=[c.name for c in CHECKS], metavar="NAME",
                        help="run only this check (repeat for several; default: all of them, listed below)")
    doctor.add_argument("--model", default=None, metavar="PATH",
                        help="the .gguf file the llama check loads (default: the bundled SmolLM2-135M-Instruct)")
    doctor.add_argument("--timeout", type=float, default=TIMEOUT_S, metavar="SECONDS",
                        help=f"how long one check may take before it is stopped and failed (default {TIMEOUT_S:g})")
    doctor.add_argument("--json", action="store_true",
                        help="print one JSON object: the environment, and the checks with name, status, detail, seconds")
    # For patchkit's own tests: the named check's process kills itself with SIGSEGV (patchkit/doctor/child.py).
    doctor.add_argument("--crash-check", action="append", choices=[c.name for c in CHECKS], help=argparse.SUPPRESS)


def _served_arguments(command: argparse.ArgumentParser) -> None:
    """The targets and options `serve` and `mcp` take."""
    command.add_argument("targets", nargs="*", metavar="[NAME=]FILE.py|module:attribute",
                         help="a Python script with a `with patchkit.capture():` block, or a module's Pipeline object; "
                              "several are served by name (NAME=, else the file's stem or the attribute's name) at "
                              "/v1/pipelines/NAME/query; or none, and the config file's `pipelines:`")
    command.add_argument("--reload", action="store_true",
                         help="when a target's file changes, load it again and serve it as the pipeline's next version "
                              "(a failed reload is logged and the version before keeps serving)")
    command.add_argument("--config", default=None, metavar="FILE", help="deploy options from a YAML, JSON or TOML file (below)")
    for name in OPTION_FLAGS:
        _option_flag(command, name)
    for name, kind in (("replicas", int), ("batch_size", int), ("plan", str)):
        _file_flag(command, name, kind)
    command.add_argument("--resources", default=None, help="with --plan auto: the pool, as cpu=5,gpu=2 (default: this machine)")


def parser() -> argparse.ArgumentParser:
    """Every command's arguments; `patchkit serve --help` lists the config file's keys."""
    root = argparse.ArgumentParser(prog="patchkit", description="Serve RAG pipelines written in plain Python.")
    commands = root.add_subparsers(dest="command", required=True)
    from patchkit.config.file import describe as describe_config_file

    serve = commands.add_parser(
        "serve", help="serve pipelines (a script's capture, or module:attribute), each by name, until Ctrl-C",
        epilog=describe_config_file(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _served_arguments(serve)
    mcp = commands.add_parser(
        "mcp", help="serve pipelines as MCP tools over stdin and stdout (for MCP clients that start their servers), "
                    "until the client closes stdin; the targets and options of serve",
        epilog=describe_config_file(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _served_arguments(mcp)
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
    _doctor_command(commands)
    return root


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    # The demo shows its answers and table, the doctor its report, not the workers' loading.
    quiet = "warning" if args.command in ("demo", "doctor") else "info"
    level = (getattr(args, "log_level", None) or quiet).upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from patchkit.errors import PatchkitError

    try:  # every error patchkit raises on purpose is one line and exit status 2; a traceback is a bug
        if args.command == "serve":
            return _serve(args)
        if args.command == "mcp":
            return _mcp(args)
        if args.command == "plan":
            return _plan(args)
        if args.command == "bench":
            from patchkit.bench import run_from_args

            return run_from_args(args)
        if args.command == "doctor":
            return _doctor(args)
        from patchkit.demo import main as demo_main

        return demo_main(args.questions, replicas=args.replicas)
    except PatchkitError as exc:  # a mistake the user can fix: its message (a line per problem), not a traceback
        for line in str(exc).splitlines():
            print(f"patchkit {args.command}: {line}", file=sys.stderr)
        return 2

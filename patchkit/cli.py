"""The `patchkit` command: `patchkit serve FILE.py` serves the pipeline a script captures;
`patchkit demo` deploys the CRAG example on real components and asks it questions."""

from __future__ import annotations

import argparse
import logging
import runpy
import secrets
import sys
from pathlib import Path

__all__ = ["main"]


def _serve(args: argparse.Namespace) -> int:
    import patchkit
    from patchkit.scheduler.config import DeploymentConfig
    from patchkit.scheduler.server import serve_blocking

    script = Path(args.file).resolve()
    if not script.is_file():
        print(f"patchkit serve: no such file: {args.file}", file=sys.stderr)
        return 2
    sys.argv = [str(script)]
    sys.path.insert(0, str(script.parent))
    # The script runs as an imported module would, as `uvicorn module:app` runs one: its
    # `if __name__ == "__main__":` block does not run. Its last capture is served.
    runpy.run_path(str(script), run_name="__patchkit_serve__")
    try:
        pipeline = patchkit.last_pipeline()
    except patchkit.PatchkitError:
        print(
            f"patchkit serve: {args.file} ran no `with patchkit.capture():` block; capture at module level "
            "(a block under `if __name__ == '__main__':` does not run when served)",
            file=sys.stderr,
        )
        return 2
    config = DeploymentConfig.resolve(
        pipeline,
        replicas=args.replicas,
        batch_size=args.batch_size,
        backend=args.backend,
        host=args.host,
        port=args.port,
        slo_ms=args.slo_ms,
        batch_wait_ms=args.batch_wait_ms,
        secret=secrets.token_urlsafe(32),
    )

    def ready(url: str) -> None:
        print(f"patchkit: serving {script.name} at {url} (Ctrl-C stops)", flush=True)

    serve_blocking(pipeline, config, ready)
    print("patchkit: stopped", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="patchkit", description="Serve RAG pipelines written in plain Python.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run a script's capture and serve its pipeline until Ctrl-C")
    serve.add_argument("file", help="a Python script with a `with patchkit.capture():` block")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--backend", default="local", choices=["local", "inprocess"])
    serve.add_argument("--replicas", type=int, default=None, help="replicas of every component (default 1)")
    serve.add_argument("--batch-size", type=int, default=None, help="batch size of every method (default: the method's own)")
    serve.add_argument("--batch-wait-ms", type=float, default=0.0, help="how long a partial batch waits for more calls")
    serve.add_argument("--slo-ms", type=float, default=None, help="the latency target of every request")
    demo = commands.add_parser("demo", help="deploy the CRAG example (pydoc corpus, SmolLM2) and ask it questions")
    demo.add_argument("questions", nargs="*", help="questions to ask instead of the built-in ones")
    demo.add_argument("--replicas", type=int, default=None, help="replicas of every component (default 1)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "serve":
        return _serve(args)
    from patchkit.demo import main as demo_main

    return demo_main(args.questions, replicas=args.replicas)


if __name__ == "__main__":
    raise SystemExit(main())

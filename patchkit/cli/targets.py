"""What `patchkit serve` serves: its targets (`[NAME=]FILE.py` or `module:attribute`, or the config file's
`pipelines:`), each loaded as a captured `Pipeline`: a script run as an imported module would be, or a module's
attribute imported from the working directory first."""

from __future__ import annotations

import runpy
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from patchkit.program.pipeline import Pipeline

__all__ = ["Target", "import_pipeline", "load_pipeline", "serve_targets", "source_file"]


@dataclass(frozen=True)
class Target:
    """A pipeline `patchkit serve` serves: the name it is served under, and where it is (`FILE.py` or
    `module:attribute`). `named`: the name was given (`NAME=...`, or the config file's `pipelines:`), not
    made from the file's stem or the attribute's name."""

    name: str
    where: str
    named: bool = True

    @classmethod
    def parse(cls, text: str) -> Target:
        """`[NAME=]FILE.py|module:attribute`, as the command line gives it. Raises ConfigError for a name
        without a target."""
        from patchkit.errors import ConfigError

        name, given, where = text.partition("=")
        if given and not any(c in name for c in "/\\:") and not Path(text).exists():
            if not where:
                raise ConfigError(f"{text!r} names no pipeline: write NAME=FILE.py or NAME=module:attribute")
            return cls(name, where)
        default = text.partition(":")[2].rsplit(".", 1)[-1] if _is_module(text) else Path(text).stem
        return cls(default, text, named=False)

    def label(self, with_name: bool = False) -> str:
        """As `patchkit serve` prints it: the file's name or module:attribute, after `NAME=` where it was named
        (or `with_name`)."""
        shown = Path(self.where).name if self.where.endswith(".py") else self.where
        return f"{self.name}={shown}" if self.named or with_name else shown


def serve_targets(given: Sequence[str], values: Mapping[str, Any], config_path: str | None) -> list[Target]:
    """The pipelines to serve: the command line's targets, or the config file's `pipelines:` (not both).

    Raises ConfigError where there are none, where both say, for a name a URL cannot hold, and for two
    pipelines of one name (saying how to name them apart)."""
    from patchkit.config.deployment import check_pipeline_name
    from patchkit.errors import ConfigError

    in_file: Mapping[str, Mapping[str, Any]] = values.get("pipelines") or {}
    if given and in_file:
        raise ConfigError(f"pipelines come from the command line ({' '.join(given)}) or from {config_path}'s `pipelines:` "
                          f"({', '.join(in_file)}), not both: drop one")
    if not given and not in_file:
        raise ConfigError("name a pipeline to serve: FILE.py or module:attribute (NAME=... to name it), or list them "
                          "under `pipelines:` in the --config file")
    targets = [Target.parse(text) for text in given] or [Target(name, options["target"]) for name, options in in_file.items()]
    for target in targets:
        try:
            check_pipeline_name(target.name)
        except ConfigError as exc:
            how = "" if target.named else f" (made from {target.where!r}: name it as NAME={target.where})"
            raise ConfigError(f"{exc}{how}") from None
    by_name: dict[str, list[Target]] = {}
    for target in targets:
        by_name.setdefault(target.name, []).append(target)
    for name, same in by_name.items():
        if len(same) > 1:
            apart = " ".join(f"{name}{i}={t.where}" for i, t in enumerate(same, 1))
            raise ConfigError(f"{len(same)} pipelines are named {name!r} ({', '.join(t.where for t in same)}): name each "
                              f"as NAME=TARGET, such as {apart}")
    return targets


def _is_module(target: str) -> bool:
    return ":" in target and not target.endswith(".py") and not Path(target).is_file()


def load_pipeline(target: str, *, again: bool = False) -> Pipeline:
    """The pipeline a `FILE.py` script's capture made (the script run again when `again`), or the one
    `module:attribute` names (the module imported again when `again`). Raises ConfigError for a file,
    module or attribute that is not there, and for a script that captures nothing."""
    return import_pipeline(target, again=again) if _is_module(target) else _run_script(target)


def source_file(target: str) -> Path | None:
    """The file `load_pipeline` reads for `target`, which `--reload` watches: the script, or the module's file."""
    if not _is_module(target):
        return Path(target).resolve()
    import importlib.util

    _working_directory_first()
    try:
        spec = importlib.util.find_spec(target.partition(":")[0])  # imports its parent packages, not the module
    except Exception:  # noqa: BLE001 - a package that does not import: `load_pipeline` raises it as Python does
        return None
    return Path(spec.origin) if spec is not None and spec.origin and spec.has_location else None


def _run_script(file: str) -> Pipeline:
    """Run the script as an imported module would, as `uvicorn module:app` runs one (its `if __name__ ==
    "__main__":` block does not run), and return the pipeline its last capture made."""
    from patchkit.errors import ConfigError

    script = Path(file).resolve()
    if not script.is_file():
        raise ConfigError(f"no such file: {file}")
    before = _last_capture()
    sys.argv = [str(script)]
    if sys.path[:1] != [str(script.parent)]:
        sys.path.insert(0, str(script.parent))
    runpy.run_path(str(script), run_name="__patchkit_serve__")
    captured = _last_capture()
    if captured is None or captured is before:  # the one before is another script's, or this one's last run's
        raise ConfigError(f"{file} ran no `with patchkit.capture():` block; capture at module level (a block under "
                          "`if __name__ == '__main__':` does not run here)")
    return captured


def _last_capture() -> Pipeline | None:
    import patchkit

    try:
        return patchkit.last_pipeline()
    except patchkit.PatchkitError:
        return None


def _working_directory_first() -> None:
    if sys.path[:1] != [str(Path.cwd())]:
        sys.path.insert(0, str(Path.cwd()))


def import_pipeline(target: str, *, again: bool = False) -> Pipeline:
    """`module:attribute` (dotted on both sides), imported from the working directory first, as Ray Serve's
    `serve run module:app` does (`again`: the module imported anew, as `importlib.reload` does); the
    attribute must be a Pipeline."""
    import difflib
    import importlib

    from patchkit.errors import ConfigError
    from patchkit.program.pipeline import Pipeline

    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"name a pipeline as module:attribute, such as app:pipeline; got {target!r}")
    _working_directory_first()
    try:
        module = importlib.import_module(module_name)
        if again:
            module = importlib.reload(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or not (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise  # the module is there; something it imports is not
        raise ConfigError(f"no module named {module_name!r} (looked in {Path.cwd()} and sys.path)") from None
    found: object = module
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

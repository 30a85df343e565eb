"""What the load generator's figures are made of: interpolated percentiles and goodput. Standard library only."""

from __future__ import annotations

import statistics


def goodput(records: list[dict], wall_s: float, slo_ttft_s: float, slo_itl_ms: float, num_errors: int = 0) -> dict:
    """Requests that met the SLO (TTFT <= ``slo_ttft_s`` and their p99 inter-token gap <= ``slo_itl_ms``):
    per second of the run and as a fraction of all requests (failed ones count as missing it)."""
    good = sum(1 for r in records if r["ttft_s"] <= slo_ttft_s and r["itl_p99_ms"] <= slo_itl_ms)
    total = len(records) + num_errors
    return {"slo_ttft_s": slo_ttft_s, "slo_itl_ms": slo_itl_ms, "good_requests": good,
            "req_per_s": round(good / wall_s, 3) if wall_s > 0 else 0.0,
            "fraction": round(good / total, 3) if total else 0.0}


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {"p50": round(quantile(ordered, 0.5), 4), "p90": round(quantile(ordered, 0.9), 4), "p99": round(quantile(ordered, 0.99), 4),
            "mean": round(statistics.mean(ordered), 4)}


def quantile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted values, interpolated linearly between the closest ranks (numpy's default, as
    vLLM's benchmark computes them): the p50 of an even count is the mean of the two middle values."""
    position = q * (len(ordered) - 1)
    below = int(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)

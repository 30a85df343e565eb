"""The serving metrics of ``GET /metrics``, exported through Ray's metrics agent as well.

Ray's agent on every node serves what its processes record with ``ray.util.metrics`` on Ray's own
Prometheus endpoint (the ``metrics_export_port``), so a cluster already scraped for Ray's metrics gets
ours with no scrape target per ingress. Each process that hosts a model runs one
:class:`RayMetricsExporter`: every ``interval_s`` it gathers its models' data (the
``{served name: {"requests": ..., "engine": ...}}`` dict that ``app.metrics.render`` takes) and sets one
Ray gauge per sample of that rendering.

Names: ``llm_serve:<name>`` becomes ``llm_serve_<name>`` (Ray discards names it does not accept and warns
that ``:`` will not be accepted), and Ray's agent prefixes ``ray_``: ``ray_llm_serve_num_requests_running``.
Labels stay as rendered (``model_name``, ``finished_reason``, ``position``, ``le``), next to the ones Ray
adds (``WorkerId``, ``NodeAddress``, ``SessionName``, ...), which keep each replica's series apart.

Why everything is a gauge, counters and histograms included: the source of truth is the engine's and the
serving layer's cumulative counters and bucket counts, read whole at each update. A Ray ``Counter`` only
takes increments (deltas computed here would drift with missed updates and restarts) and a Ray
``Histogram`` wants the single observations, which are gone by then. Setting gauges to the cumulative
values keeps them exact whatever the update and scrape timings: ``rate()``, ``increase()`` and
``histogram_quantile()`` over ``_bucket`` series with an ``le`` label work on them exactly as on the
counters and histograms of ``GET /metrics`` (a replica that restarts starts again from zero, which
``rate()`` reads as a counter reset). Only the kind announced by ``# TYPE`` differs.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import re
from typing import Any, Awaitable, Callable

from app.metrics import render

logger = logging.getLogger(__name__)

Sample = tuple[str, dict[str, str], float]  # Ray metric name, tags, value
GaugeFactory = Callable[[str, str, tuple[str, ...]], Any]  # (name, description, tag keys) -> object with .set(value, tags=)

RAY_METRICS_INTERVAL_S = 5.0  # how often a replica copies its metrics into Ray's: half Ray's own report interval (10 s), so no report goes out empty
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})? (?P<value>\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_ESCAPE = re.compile(r"\\(.)")


def ray_name(name: str) -> str:
    """A Prometheus name of ours as a Ray metric name: ``llm_serve:x`` -> ``llm_serve_x``."""
    return name.replace(":", "_")


def samples(by_model: dict[str, dict]) -> list[Sample]:
    """Every sample ``GET /metrics`` would show for ``by_model``, named for Ray, its labels as tags."""
    result = []
    for line in render(by_model).splitlines():
        match = _SAMPLE.match(line)
        if match is None:  # a "# TYPE" line or a blank one
            continue
        tags = {key: _unescape(value) for key, value in _LABEL.findall(match["labels"] or "")}
        result.append((ray_name(match["name"]), tags, float(match["value"])))
    return result


def _unescape(value: str) -> str:
    return _ESCAPE.sub(lambda m: "\n" if m[1] == "n" else m[1], value)


def _ray_gauge(name: str, description: str, tag_keys: tuple[str, ...]) -> Any:
    from ray.util.metrics import Gauge  # the only use of Ray here

    return Gauge(name, description=description, tag_keys=tag_keys)


class RayMetricsExporter:
    """Mirrors our metrics into Ray gauges; one per process that hosts a model, updated periodically."""

    def __init__(self, gauge_factory: GaugeFactory = _ray_gauge) -> None:
        self._gauge_factory = gauge_factory
        self._gauges: dict[str, tuple[Any, tuple[str, ...]]] = {}  # Ray name -> (gauge, its tag keys)
        self._failing = False

    def update(self, by_model: dict[str, dict]) -> int:
        """Set the gauges to ``by_model``'s values; returns the number of samples set."""
        exported = samples(by_model)
        for name, tags, value in exported:
            if name not in self._gauges:
                description = f"{name.replace('llm_serve_', 'llm_serve:', 1)} of GET /metrics (counters and histograms: cumulative)"
                self._gauges[name] = (self._gauge_factory(name, description, tuple(tags)), tuple(tags))
            gauge, keys = self._gauges[name]
            gauge.set(value, tags={key: tags.get(key, "") for key in keys})
        return len(exported)

    async def run_periodically(self, gather: Callable[[], Awaitable[dict] | dict], interval_s: float) -> None:
        """``update(await gather())`` every ``interval_s`` until cancelled; a failed round is logged and skipped.

        ``gather`` returns the per-model dict, or an awaitable of it (``ModelServer.metrics`` is plain, a route's is async).
        """
        while True:
            try:
                gathered = gather()
                self.update(await gathered if inspect.isawaitable(gathered) else gathered)
                self._failing = False
            except asyncio.CancelledError:
                raise
            except Exception:  # a metrics export must never end the loop (nor take the replica down)
                if not self._failing:  # once per run of failures, not every interval
                    logger.warning("exporting metrics to Ray failed; retrying every %s s", interval_s, exc_info=True)
                self._failing = True
            await asyncio.sleep(interval_s)

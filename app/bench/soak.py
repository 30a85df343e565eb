"""Soak: the app under a steady request rate for minutes, watching for failures and growing memory.

``python -m app.bench soak`` starts the app with ``serve run`` (as ``compare`` does: the whole config, on
loopback), sends short streamed completions at a fixed rate (open loop: a request leaves every 1/rate s
whether or not the earlier ones are done) for ``--duration-s``, and every ``SAMPLE_EVERY_S`` sums the
resident memory (RSS) of the app's processes by part: the ``serve run`` driver, each Serve deployment's
replicas, their engine-core processes, Serve's controller and proxy, and Ray's own (GCS, raylet,
dashboard, agents, idle workers). It reports failed requests (anything but a complete 200 stream; a
healthy run has none), per part the RSS at start and end and its slope in MB/min (least squares over the
samples, and over the second half alone, after the allocators' warm-up), and latency percentiles.

Only the processes of this ``serve run`` are measured: its descendants and the members of its process
session, never another Ray on the machine. Runs ``serve run`` as a subprocess, so it never imports ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import psutil
import yaml

from app.bench.percentiles import percentiles
from app.bench.prompts import WORDS
from app.bench.server import ROOT, _serve_command, _stop, _wait_ready

SAMPLE_EVERY_S = 10.0
PROMPT_WORDS = 16  # short requests: a soak is about time, not about load
MAX_TOKENS = 32
REQUEST_TIMEOUT_S = 120
MB = 1024 * 1024


def run_soak(app_config: dict, port: int, log_path: Path, duration_s: float, rate: float, model: str,
             server_factory: str | None = None) -> dict:
    """Serve ``app_config`` (a configs/*.yaml dict), soak it, and return the report (see the module doc)."""
    with serving(app_config, port, log_path, server_factory) as (url, process):
        report = asyncio.run(_soak(url, model, process, duration_s, rate))
    report.update({"server_factory": server_factory, "model": model, "rate_per_s": rate, "duration_s": duration_s,
                   "prompt_words": PROMPT_WORDS, "max_tokens": MAX_TOKENS, "sample_every_s": SAMPLE_EVERY_S})
    return report


@contextlib.contextmanager
def serving(app_config: dict, port: int, log_path: Path, server_factory: str | None) -> Iterator[tuple[str, subprocess.Popen]]:
    """``build_app`` on ``app_config`` (and a ``server_factory``, e.g. the tests' fake model), served as ``make serve``
    serves it; yields (base URL, the ``serve run`` process, leader of its own process session)."""
    with socket.socket() as probe:  # a server already there would answer in our place
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            raise SystemExit(f"soak: port {port} is in use; pick a free one with --port") from None
    with tempfile.TemporaryDirectory() as tmp:
        config_file = Path(tmp) / "app.yaml"
        config_file.write_text(yaml.safe_dump(app_config))
        args = {"config": str(config_file), **({"server_factory": server_factory} if server_factory else {})}
        serve_file = Path(tmp) / "serve.yaml"
        serve_file.write_text(yaml.safe_dump({
            "proxy_location": "EveryNode",
            "http_options": {"host": "127.0.0.1", "port": port},
            "applications": [{"name": "default", "route_prefix": "/", "import_path": "deployments.builder:build_app",
                              "args": args}],
        }))
        # the repository on the workers' path: a server_factory may live outside the installed packages (tests/)
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a Ray of its own, as `serve run` starts
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as log:
            process = subprocess.Popen([*_serve_command(ROOT), str(serve_file)], cwd=ROOT,
                                       env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            url = f"http://127.0.0.1:{port}"
            try:
                _wait_ready(url, process, 600, log_path)
                yield url, process
            finally:
                _stop(process)


@dataclass
class Timing:
    ttft_s: float
    e2e_s: float
    tokens: int


async def _stream(http: httpx.AsyncClient, model: str, prompt: str) -> Timing:
    """One streamed completion of exactly MAX_TOKENS tokens; anything but a complete 200 stream raises."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first, usage, done = None, {}, False
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}")
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                    first = time.perf_counter()
                usage = chunk.get("usage") or usage
    tokens = usage.get("completion_tokens", 0)
    if not done or first is None or tokens != MAX_TOKENS:
        raise RuntimeError(f"incomplete stream: [DONE] {done}, {tokens} of {MAX_TOKENS} tokens")
    return Timing(first - sent, time.perf_counter() - sent, tokens)


async def _soak(url: str, model: str, server: subprocess.Popen, duration_s: float, rate: float) -> dict:
    root_pid = server.pid
    rng = random.Random(0)
    timings: list[Timing] = []
    errors: list[str] = []
    in_flight, max_in_flight = 0, 0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits) as http:

        async def one(prompt: str) -> None:
            nonlocal in_flight, max_in_flight
            in_flight += 1
            max_in_flight = max(max_in_flight, in_flight)
            try:
                timings.append(await _stream(http, model, prompt))
            except (httpx.HTTPError, RuntimeError, ValueError) as exc:  # counted: a soak must have none
                errors.append(f"{time.monotonic() - started:.1f}s {type(exc).__name__}: {exc}"[:300])
            finally:
                in_flight -= 1

        started = time.monotonic()
        for _ in range(4):  # first requests pay one-time costs (allocator, kernels): not part of the soak
            await one(" ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS)))
        timings.clear()
        started = time.monotonic()
        samples = [_sample(root_pid, 0.0)]
        tasks: list[asyncio.Task] = []
        next_send, next_sample = started, started + SAMPLE_EVERY_S
        while (now := time.monotonic()) < started + duration_s and server.poll() is None:
            if now >= next_sample:
                samples.append(await asyncio.to_thread(_sample, root_pid, now - started))
                _print_sample(samples[-1], len(timings), len(errors), in_flight)
                next_sample += SAMPLE_EVERY_S
            if now >= next_send:
                prompt = " ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS))
                tasks.append(asyncio.create_task(one(prompt)))
                next_send += 1.0 / rate
            await asyncio.sleep(max(0.0, min(next_send, next_sample) - time.monotonic()))
        sent_s = time.monotonic() - started
        await asyncio.gather(*tasks)  # the last ones finish (or fail), then the final sample
        samples.append(await asyncio.to_thread(_sample, root_pid, time.monotonic() - started))
        _print_sample(samples[-1], len(timings), len(errors), in_flight)
    return {
        "server_exited": None if server.poll() is None else f"serve run exited with {server.returncode} after {sent_s:.0f} s",
        "requests": {"sent": len(tasks), "ok": len(timings), "failed": len(errors), "first_errors": errors[:5],
                     "achieved_rate_per_s": round(len(tasks) / sent_s, 3), "max_in_flight": max_in_flight},
        "latency": {"ttft_s": percentiles([t.ttft_s for t in timings]), "e2e_s": percentiles([t.e2e_s for t in timings]),
                    "tpot_ms": percentiles([(t.e2e_s - t.ttft_s) * 1000 / max(t.tokens - 1, 1) for t in timings])},
        "rss_mb": memory_summary(samples),
        "load_average": {"start": samples[0]["load_average"], "end": samples[-1]["load_average"]},
        "samples": samples,
    }


def app_processes(root_pid: int) -> list[psutil.Process]:
    """``serve run``, its descendants, and whatever else lives in its process session (start_new_session)."""
    found: dict[int, psutil.Process] = {}
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(root_pid)
        found = {p.pid: p for p in [root, *root.children(recursive=True)]}
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if process.pid not in found and os.getsid(process.pid) == root_pid:
                found[process.pid] = process
    return list(found.values())


def part_of(command: str, parent_part: str | None, is_root: bool) -> str:
    """Which part of the app a process is, from the command line Ray gives it ("ray::<actor>[.<method>]")."""
    if is_root:
        return "serve run (driver)"
    if command.startswith("ray::"):
        actor = re.sub(r"\.[a-z_][a-z0-9_]*$", "", command[5:].split(" ")[0].strip()) or "worker"  # not the method running
        if actor.startswith("ServeReplica:"):
            return "replica " + ":".join(actor.split(":")[2:])  # ServeReplica:<app>:<deployment>
        return {"ServeController": "serve controller", "ProxyActor": "serve proxy", "IDLE": "idle workers",
                "DashboardAgent": "dashboard agent", "RuntimeEnvAgent": "runtime env agent"}.get(actor, actor)
    if "multiprocessing.resource_tracker" in command:
        return "multiprocessing resource trackers"
    if parent_part is not None and parent_part.startswith("replica ") and "multiprocessing.spawn" in command:
        return parent_part + " / engine core"  # the replica's own child: its engine process (separate_process)
    for marker, part in (("gcs_server", "gcs"), ("raylet", "raylet"), ("dashboard/agent.py", "dashboard agent"),
                         ("runtime_env/agent", "runtime env agent"), ("ray-dashboard-", "dashboard"),
                         ("dashboard.py", "dashboard"), ("log_monitor", "log monitor"), ("monitor.py", "autoscaler monitor")):
        if marker in command:
            return part
    words = command.split()
    program = Path(words[0]).name if words else "?"
    if "-c" in words:  # python -c "<code>": its first words
        script = " ".join(words[words.index("-c") + 1:][:3])
    else:
        script = next((Path(w).name for w in words[1:] if not w.startswith("-")), "")
    return f"other: {program} {script}".strip()[:60]


def _sample(root_pid: int, t_s: float) -> dict:
    """RSS (MB) summed by part, and each part's process count, at ``t_s`` into the soak."""
    rows = []
    for process in app_processes(root_pid):
        with contextlib.suppress(psutil.Error):
            rows.append((process.pid, process.ppid(), " ".join(process.cmdline()) or process.name(), process.memory_info().rss))
    commands = {pid: command for pid, _, command, _ in rows}
    parts_by_pid: dict[int, str] = {}

    def part(pid: int, ppid: int, command: str) -> str:
        if pid not in parts_by_pid:
            parent = commands.get(ppid)
            parent_part = part(ppid, _ppid(rows, ppid), parent) if parent is not None and ppid != pid else None
            parts_by_pid[pid] = part_of(command, parent_part, pid == root_pid)
        return parts_by_pid[pid]

    rss: dict[str, float] = {}
    count: dict[str, int] = {}
    for pid, ppid, command, resident in rows:
        name = part(pid, ppid, command)
        rss[name] = rss.get(name, 0.0) + resident / MB
        count[name] = count.get(name, 0) + 1
    return {"t_s": round(t_s, 1), "rss_mb": {k: round(v, 1) for k, v in sorted(rss.items())}, "processes": count,
            "total_rss_mb": round(sum(rss.values()), 1), "load_average": round(os.getloadavg()[0], 2)}


def _ppid(rows: list[tuple[int, int, str, int]], pid: int) -> int:
    return next((ppid for p, ppid, _, _ in rows if p == pid), pid)


def memory_summary(samples: list[dict]) -> dict:
    """Per part (and in total): RSS at start and end, the largest, and the slope in MB/min."""
    parts = sorted({name for s in samples for name in s["rss_mb"]}) + ["total"]
    summary = {}
    for name in parts:
        points = [(s["t_s"] / 60, s["total_rss_mb"] if name == "total" else s["rss_mb"].get(name, 0.0)) for s in samples]
        half = points[len(points) // 2:]
        summary[name] = {"start": points[0][1], "end": points[-1][1], "max": max(v for _, v in points),
                         "slope_mb_per_min": slope(points), "slope_second_half_mb_per_min": slope(half)}
    return summary


def slope(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (x, y) points; None for fewer than two distinct x."""
    if len({x for x, _ in points}) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    covariance = sum((x - mean_x) * (y - mean_y) for x, y in points)
    return round(covariance / sum((x - mean_x) ** 2 for x, _ in points), 2)


def _print_sample(sample: dict, ok: int, failed: int, in_flight: int) -> None:
    print(f"t={sample['t_s']:6.1f}s ok={ok} failed={failed} in_flight={in_flight} "
          f"rss_total={sample['total_rss_mb']:.0f}MB load={sample['load_average']}", flush=True)


def format_table(report: dict) -> str:
    """The soak's figures as markdown: requests, latency, then RSS per part."""
    r, lat = report["requests"], report["latency"]
    lines = [
        f"soak: {report['duration_s']:.0f} s at {report['rate_per_s']} req/s ({report['prompt_words']}-word prompts, "
        f"{report['max_tokens']} streamed tokens): {r['sent']} sent, {r['ok']} ok, **{r['failed']} failed**, "
        f"at most {r['max_in_flight']} in flight",
        f"TTFT p50/p90/p99 {lat['ttft_s'].get('p50')}/{lat['ttft_s'].get('p90')}/{lat['ttft_s'].get('p99')} s, "
        f"E2E p50/p90/p99 {lat['e2e_s'].get('p50')}/{lat['e2e_s'].get('p90')}/{lat['e2e_s'].get('p99')} s",
        *([f"**{report['server_exited']}**"] if report.get("server_exited") else []),
        "",
        "| part | RSS start (MB) | RSS end (MB) | max (MB) | slope (MB/min) | slope, second half (MB/min) |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in report["rss_mb"].items():
        lines.append(f"| {name} | {m['start']} | {m['end']} | {m['max']} | {m['slope_mb_per_min']} | {m['slope_second_half_mb_per_min']} |")
    return "\n".join(lines)

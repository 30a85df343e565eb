"""The report's tables: each table of a CPU class's section, from the result files read as sources
(app/bench/report_sources.py); app/bench/report.py puts them in order. Standard library only."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from app.bench.report_sources import Source

MODE_LABELS = {"none": "naive: one request at a time (`batching: none`)", "dynamic": "dynamic batching (`batching: dynamic`)",
               "continuous": "continuous batching (`batching: continuous`, default)"}


# --- formatting -----------------------------------------------------------------------------------------------


def _num(value, digits: int = 1) -> str:
    if value is None or value == "":
        return "–"
    if isinstance(value, (int, float)):
        return f"{value:,.{digits}f}"
    return str(value)


def _ratio(value, reference) -> str:
    if not value or not reference:
        return "–"
    return f"{value / reference:.2f}x"


def _pct(run: dict | None, metric: str, q: str = "p50", scale: float = 1.0, digits: int = 1) -> str:
    values = (run or {}).get(metric) or {}
    return _num(values[q] * scale, digits) if q in values else "–"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def _goodput_cell(run: dict | None) -> str:
    good = (run or {}).get("goodput")
    if not good:
        return "–"
    return f"{good['req_per_s']:.2f}/s ({good['fraction']:.0%})"


# --- what each kind of file holds, as rows ------------------------------------------------------------------


@dataclass
class ServerRuns:
    """One server's standard workloads in one source."""

    name: str
    runs: dict  # W1.. -> load result
    source: Source
    model: str = ""  # the served model, where a file names one other than the embedded default


DEFAULT_MODELS = ("", "smollm2-135m-instruct", "smollm2-135m")  # the embedded model, under our name and vLLM's


def servers(sources: list[Source]) -> list[ServerRuns]:
    """This project (each compare file's ``continuous`` mode) and every peer, in the order given."""
    found = []
    for source in sources:
        if source.kind == "compare":
            modes = source.data["modes"]
            mode = "continuous" if "continuous" in modes else next(iter(modes), None)
            if mode:
                found.append(ServerRuns(f"this project (`{mode}`)", modes[mode], source))
        elif source.kind == "peer":
            model = source.data.get("model") or ""
            model = "" if model in DEFAULT_MODELS else model
            for name, runs in source.data["servers"].items():
                found.append(ServerRuns(f"{name} on {model}" if model else name, runs, source, model))
    return found


def _sitting_reference(found: list[ServerRuns], folder: Path, model: str, prefix: str, workload: str) -> float | None:
    """tok/s on ``workload`` of the ``prefix`` peer (vllm, naive) measured in one sitting (``folder``: a folder of
    result files) on ``model``: the median of its runs there, of its faster setting (vLLM in bf16 or fp32). None
    where that sitting has none: a ratio across sittings or models would measure the machine's drift or the model."""
    settings: dict[str, list[float]] = {}
    for s in found:
        value = _tok_s(s, workload)
        if s.name.lower().startswith(prefix) and s.model == model and s.source.path.parent == folder and value is not None:
            settings.setdefault(s.name, []).append(value)
    return max((statistics.median(values) for values in settings.values()), default=None)


def _tok_s(server: ServerRuns | None, workload: str):
    return ((server.runs.get(workload) or {}).get("output_tok_per_s")) if server else None


def _ratios(found: list[ServerRuns], folder: Path, model: str, w1, w2) -> list[str]:
    """W1 vs vLLM, W1 vs naive, W2 vs vLLM, W2 vs naive, each against its sitting's peer on the same model."""
    return [_ratio(value, _sitting_reference(found, folder, model, peer, workload))
            for workload, value in (("W1", w1), ("W2", w2)) for peer in ("vllm", "naive")]


def _failed_cell(*runs: dict | None) -> str:
    return str(sum((run or {}).get("num_errors", 0) for run in runs))


def server_table(sources: list[Source]) -> list[str]:
    found = servers(sources)
    hf = [s for s in sources if s.kind == "hf"]
    if not found and not hf:
        return ["No `compare` or `peer` results among these files."]
    header = ["server", "W1 tok/s", "W1 TTFT p50 (s)", "W1 TPOT p50 (ms)", "W1 ITL p50 (ms)", "W1 goodput", "W1 chunks / tokens",
              "W2 tok/s", "W2 TPOT p50 (ms)", "failed (W1, W2)", "W1 vs vLLM", "W1 vs naive", "W2 vs vLLM", "W2 vs naive", "source"]
    rows = []
    for s in found:
        w1, w2 = s.runs.get("W1"), s.runs.get("W2")
        rows.append([s.name, _num((w1 or {}).get("output_tok_per_s")), _pct(w1, "ttft_s", digits=2), _pct(w1, "tpot_ms"),
                     _pct(w1, "itl_ms"), _goodput_cell(w1), _streamed_cell(w1), _num((w2 or {}).get("output_tok_per_s")), _pct(w2, "tpot_ms"),
                     _failed_cell(w1, w2), *_ratios(found, s.source.path.parent, s.model, _tok_s(s, "W1"), _tok_s(s, "W2")), s.source.ref])
    for source in hf:
        batch = (source.data.get("generate_batch") or {}).get("output_tok_per_s")
        single = (source.data.get("generate_batch1") or {}).get("output_tok_per_s")
        dtype = (source.data.get("spec") or {}).get("dtype", "")
        rows.append([f"transformers offline, {dtype}: `generate_batch` (W1) / `generate` batch 1 (W2)", _num(batch), "–", "–", "–", "–", "–",
                     _num(single), "–", "–", *_ratios(found, source.path.parent, "", batch, single), source.ref])
    lines = _table(header, rows) + ["", "Ratios are to the peer measured in the same sitting (one folder of result files) on "
                                    "the same model: the median of its runs there, of its faster setting; – where that "
                                    "sitting has none. Failed requests are not in the other figures."]
    missing = [what for what, prefix in (("vLLM (`make bench-vllm`)", "vllm"), ("the naive baseline (`make bench-naive`)", "naive"))
               if not any(s.name.lower().startswith(prefix) for s in found)]
    if missing:
        lines += ["", f"No result for {' or '.join(missing)} among these files: those ratios are left out."]
    return lines


def seeds_table(sources: list[Source]) -> list[str]:
    """Served naive, dynamic, continuous (compare) and quantized (quant) on W1, ratios to the same file's naive row."""
    header = ["setup", "W1 tok/s", "TTFT p50 (s)", "TPOT p50 (ms)", "ITL p50 (ms)", "E2E p50 (s)", "vs naive", "source"]
    rows = []
    compare_naive = next((w1.get("output_tok_per_s") for s in sources if s.kind == "compare"
                          for w1 in [(s.data["modes"].get("none") or {}).get("W1") or {}] if w1), None)
    for source in sources:
        if source.kind == "compare":
            modes = source.data["modes"]
            base = (modes.get("none", {}).get("W1") or {}).get("output_tok_per_s")
            dtype = source.data.get("dtype", "auto")
            for mode, runs in modes.items():
                w1 = runs.get("W1") or {}
                rows.append([f"{MODE_LABELS.get(mode, mode)}, dtype {dtype}", _num(w1.get("output_tok_per_s")), _pct(w1, "ttft_s", digits=2),
                             _pct(w1, "tpot_ms"), _pct(w1, "itl_ms"), _pct(w1, "e2e_s"), _ratio(w1.get("output_tok_per_s"), base), source.ref])
        elif source.kind == "quant" and source.data.get("serving"):
            serving = source.data["serving"]
            # its own naive row, else the compare run's (a quant run of GPTQ alone, in the same `make bench` run)
            base = next((r.get("output_tok_per_s") for r in serving.values() if r.get("batching") == "none"), compare_naive)
            for label, w1 in serving.items():
                rows.append([f"{label} (quantization {w1.get('quantization', '?')}, `{w1.get('batching', '?')}`)", _num(w1.get("output_tok_per_s")),
                             _pct(w1, "ttft_s", digits=2), _pct(w1, "tpot_ms"), _pct(w1, "itl_ms"), _pct(w1, "e2e_s"),
                             _ratio(w1.get("output_tok_per_s"), base), source.ref])
    if not rows:
        return ["No `compare` or `quant` results among these files."]
    return _table(header, rows) + ["", "Ratios are to the naive row of the same file (the same sitting), or of the compare "
                                   "run beside it where a quant run has none."]


def other_workloads_table(sources: list[Source]) -> list[str]:
    rows = []
    for s in servers(sources):
        for name in ("W3", "W4"):
            run = s.runs.get(name)
            if run:
                rows.append([s.name, name, _num(run.get("output_tok_per_s")), _num(run.get("mean_prompt_tokens"), 0), _pct(run, "ttft_s", digits=2),
                             _pct(run, "ttft_s", "p99", digits=2), _pct(run, "tpot_ms"), _pct(run, "itl_ms"), _goodput_cell(run), s.source.ref])
    if not rows:
        return []
    header = ["server", "workload", "tok/s", "prompt tokens", "TTFT p50 (s)", "TTFT p99 (s)", "TPOT p50 (ms)", "ITL p50 (ms)", "goodput", "source"]
    return _table(header, rows)


def medians_table(sources: list[Source]) -> list[str]:
    """Servers measured more than once (alternated runs of one sitting): the median of each figure, ratios to the
    median of the vLLM runs on the same model (the vLLM setting with the higher W1 where there are several)."""
    groups: dict[str, list[ServerRuns]] = {}
    for server in servers(sources):  # one sitting is one folder of result files
        groups.setdefault(f"{server.name}\0{server.source.path.parent}", []).append(server)
    groups = {key: runs for key, runs in groups.items() if len(runs) > 1}
    if not groups:
        return []
    medians = {key: _medians(runs) for key, runs in groups.items()}
    rows = []
    for key, runs in groups.items():
        name, figures = runs[0].name, medians[key]
        reference = _best_vllm(medians, key)
        rows.append([name, str(len(runs)), _num(figures["W1"]), _num(figures["W1 TTFT"], 2), _num(figures["W1 TPOT"]),
                     _num(figures["W2"]), _num(figures["W5 gap"], 0), _num(figures["W5 TTFT"], 2), figures["streamed"],
                     str(figures["failed"]), _ratio(figures["W1"], (reference or {}).get("W1")),
                     _ratio(figures["W2"], (reference or {}).get("W2")), _sitting(runs), " ".join(r.source.ref for r in runs)])
    header = ["server", "runs", "W1 tok/s", "W1 TTFT p50 (s)", "W1 TPOT p50 (ms)", "W2 tok/s", "W5 largest gap (ms)",
              "W5 long prompt TTFT (s)", "chunks / tokens", "failed", "W1 vs vLLM", "W2 vs vLLM", "sitting (UTC)", "sources"]
    return _table(header, rows) + ["", "Each figure is the median over one sitting's runs (a row per sitting, by its "
                                   "first run's start); chunks / tokens and failed requests are summed over every run "
                                   "and workload."]


def _sitting(runs: list[ServerRuns]) -> str:
    """When the sitting's first run of this server began (several sittings of one class each get a row)."""
    started = sorted(r.source.data["started_utc"].removesuffix(" UTC") for r in runs if r.source.data.get("started_utc"))
    return started[0][:16] if started else "–"


def _medians(runs: list[ServerRuns]) -> dict:
    def median(values: list) -> float | None:
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    def get(run: ServerRuns, workload: str, *path):
        value = run.runs.get(workload) or {}
        for key in path:
            value = (value or {}).get(key) if isinstance(value, dict) else None
        return value

    counted = [r.runs[w] for r in runs for w in r.runs if "streamed_chunks" in r.runs[w]]
    chunks, tokens = sum(c["streamed_chunks"] for c in counted), sum(c.get("output_tokens", 0) for c in counted)
    return {"W1": median([get(r, "W1", "output_tok_per_s") for r in runs]),
            "W1 TTFT": median([get(r, "W1", "ttft_s", "p50") for r in runs]),
            "W1 TPOT": median([get(r, "W1", "tpot_ms", "p50") for r in runs]),
            "W2": median([get(r, "W2", "output_tok_per_s") for r in runs]),
            "W5 gap": median([get(r, "W5", "mixed", "stream_gap_max_ms") for r in runs]),
            "W5 TTFT": median([get(r, "W5", "mixed", "long_prompt_ttft_s") for r in runs]),
            "streamed": f"{chunks} / {tokens}" if chunks else "–",
            "failed": sum(r.runs[w].get("num_errors", 0) for r in runs for w in r.runs)}


def _best_vllm(medians: dict[str, dict], key: str) -> dict | None:
    """The vLLM setting of ``key``'s sitting and model with the highest median W1."""
    name, folder = key.split("\0")
    model = name.split(" on ", 1)[1] if " on " in name else ""
    suffix = f" on {model}" if model else ""
    candidates = [m for other, m in medians.items() if other.lower().startswith("vllm") and other.endswith(f"\0{folder}")
                  and other.split("\0")[0].endswith(suffix) and (model or " on " not in other) and m["W1"] is not None]
    return max(candidates, key=lambda m: m["W1"], default=None)


def mixed_table(sources: list[Source]) -> list[str]:
    """W5 per server: what the streams in flight pay when a long prompt arrives."""
    rows = []
    for s in servers(sources):
        run = s.runs.get("W5") or {}
        mixed = run.get("mixed")
        if mixed:
            rows.append([s.name, _num(mixed.get("stream_gap_max_ms"), 0), _pct(run, "itl_ms", "p99", digits=0), _pct(run, "itl_ms", digits=0),
                         _num(mixed.get("long_prompt_tokens"), 0), _num(mixed.get("long_prompt_ttft_s"), 2), _streamed_cell(run),
                         str(run.get("num_errors", 0)), s.source.ref])
    if not rows:
        return []
    header = ["server", "streams' largest gap (ms)", "ITL p99 (ms)", "ITL p50 (ms)", "long prompt tokens", "long prompt TTFT (s)",
              "chunks / tokens", "failed", "source"]
    return _table(header, rows)


def _streamed_cell(run: dict | None) -> str:
    """Streamed text chunks / generated tokens, as the load generator counted them (equal: every token streamed)."""
    if not run or "streamed_chunks" not in run:
        return "–"
    return f"{run['streamed_chunks']} / {run.get('output_tokens', '?')}"


def sweep_table(result: dict) -> str:
    header = ["concurrency", "requests", "tok/s", "TTFT p50/p90/p99 (s)", "TPOT p50/p90/p99 (ms)", "ITL p50/p90/p99 (ms)", "goodput"]
    rows = []
    for concurrency, run in sorted(result.get("levels", {}).items(), key=lambda kv: int(kv[0])):
        if not run.get("num_requests"):
            rows.append([concurrency, "0", f"failed: {run.get('first_error', '?')[:60]}", "", "", "", ""])
            continue

        def three(metric: str, digits: int) -> str:
            return " / ".join(_pct(run, metric, q, digits=digits) for q in ("p50", "p90", "p99"))

        errors = f" ({run['num_errors']} failed)" if run.get("num_errors") else ""
        rows.append([concurrency, f"{run['num_requests']}{errors}", _num(run.get("output_tok_per_s")), three("ttft_s", 2), three("tpot_ms", 0),
                     three("itl_ms", 0), _goodput_cell(run)])
    return "\n".join(_table(header, rows))


def load_runs(sources: list[Source]) -> list[tuple[str, str, dict, Source]]:
    """Every load result among the sources: (server, workload or level, result, source)."""
    runs = []
    for s in servers(sources):
        runs += [(s.name, name, run, s.source) for name, run in s.runs.items()]
    for source in sources:
        if source.kind == "compare":
            for mode, mode_runs in source.data["modes"].items():
                if mode != "continuous":
                    runs += [(f"this project (`{mode}`)", name, run, source) for name, run in mode_runs.items()]
        elif source.kind == "sweep":
            for concurrency, run in source.data["levels"].items():
                runs.append((source.data.get("sweep", "sweep"), f"{source.data.get('workload', 'random')} at concurrency {concurrency}", run, source))
        elif source.kind == "load":
            runs.append((source.data["spec"].get("base_url", "load"), source.data["spec"].get("workload", "random"), source.data, source))
    return runs


def goodput_table(sources: list[Source]) -> list[str]:
    rows = []
    for server, workload, run, source in load_runs(sources):
        good = run.get("goodput")
        if good:
            total = run.get("num_requests", 0) + run.get("num_errors", 0)
            rows.append([server, workload, f"TTFT <= {good['slo_ttft_s']:g} s, p99 ITL <= {good['slo_itl_ms']:g} ms",
                         f"{good['good_requests']}/{total}", f"{good['req_per_s']:.3f}", f"{good['fraction']:.0%}", source.ref])
        else:
            rows.append([server, workload, "not recorded (the file predates goodput)", "–", "–", "–", source.ref])
    if not rows:
        return ["No load results among these files."]
    return _table(["server", "workload", "SLO", "met", "goodput (req/s)", "share", "source"], rows)


def sources_table(sources: list[Source]) -> list[str]:
    rows = []
    for s in sources:
        machine = s.data.get("machine") or {}
        when = s.data.get("started_utc")
        when = f"{when} to {s.data['finished_utc'][11:]}" if when and s.data.get("finished_utc") else (when or "not recorded")
        rows.append([s.ref, f"`{s.path.name}`", s.kind, f"`{s.command}`" if s.data.get("command") else s.command, when, s.cpu_class,
                     str(machine.get("cpus", "?")), str(machine.get("torch", "?")), machine.get("cuda") or "none"])
    return _table(["#", "file", "kind", "command", "when (UTC)", "CPU class", "CPUs", "torch", "GPU"], rows)


# --- the document ---------------------------------------------------------------------------------------------

"""The benchmark report and the load generator's goodput and workloads, on synthetic data: no server, no model."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from app.bench import load, plots, report
from app.bench.percentiles import goodput, percentiles
from app.bench.__main__ import main as bench_main


def run(tok_s: float, ttft: float = 1.0, tpot: float = 50.0, itl: float = 45.0, good: tuple[int, int] | None = (30, 32)) -> dict:
    result = {"num_requests": 32, "num_errors": 0, "output_tok_per_s": tok_s, "mean_prompt_tokens": 64.0,
              "ttft_s": {"p50": ttft, "p90": ttft * 2, "p99": ttft * 3, "mean": ttft},
              "tpot_ms": {"p50": tpot, "p90": tpot * 1.2, "p99": tpot * 1.5, "mean": tpot},
              "itl_ms": {"p50": itl, "p90": itl * 1.5, "p99": itl * 4, "mean": itl},
              "e2e_s": {"p50": 10.0, "p90": 12.0, "p99": 13.0, "mean": 10.0}}
    if good:
        result["goodput"] = {"slo_ttft_s": 2.0, "slo_itl_ms": 200.0, "good_requests": good[0], "req_per_s": 1.5,
                             "fraction": good[0] / good[1]}
    return result


MACHINE = {"platform": "Linux", "cpus": 2, "torch": "2.13.0+cpu", "cuda": None, "cpu_class": ["avx2", "avx512_bf16", "avx512f"]}


@pytest.fixture
def files(tmp_path):
    data = {
        "compare.json": {"config": "configs/smollm2-cpu.yaml", "dtype": "auto", "command": "python -m app.bench compare",
                         "started_utc": "2026-11-24 07:43:00 UTC", "finished_utc": "2026-11-24 07:50:00 UTC", "machine": MACHINE,
                         "modes": {"none": {"W1": run(40.0)}, "dynamic": {"W1": run(200.0)},
                                   "continuous": {"W1": {**run(250.0), "output_tokens": 4096, "streamed_chunks": 4096},
                                                  "W2": run(50.0), "W3": run(300.0), "W4": run(260.0),
                                                  "W5": {**run(90.0), "output_tokens": 2048, "streamed_chunks": 2048,
                                                         "mixed": {"streams": 8, "stream_gap_max_ms": 180.0, "long_prompt_tokens": 1905,
                                                                   "long_prompt_ttft_s": 4.1}}}}},
        "peer-vllm.json": {"peer": "vllm", "url": "http://127.0.0.1:8002", "model": "smollm2-135m", "machine": MACHINE,
                           "command": "python -m app.bench peer --name vllm", "servers": {"vllm": {"W1": run(500.0), "W2": run(25.0)}}},
        "peer-naive.json": {"peer": "naive", "machine": MACHINE, "servers": {"naive": {"W1": run(20.0), "W2": run(20.0)}}},
        "hf.json": {"spec": {"dtype": "float32"}, "generate_batch": {"output_tok_per_s": 75.0},
                    "generate_batch1": {"output_tok_per_s": 15.0}, "machine": {"cpus": 2, "torch": "2.13.0+cpu"}},
        "quant.json": {"config": "c", "dtype": "float32", "fidelity": {}, "machine": MACHINE,
                       "serving": {"naive fp32": {"quantization": "none", "batching": "none", **run(10.0)},
                                   "batched GPTQ 4-bit": {"quantization": "gptq", "batching": "continuous", **run(80.0)}}},
        "sweep.json": {"sweep": "ours", "workload": "random", "model": "m", "machine": MACHINE,
                       "levels": {"1": run(40.0), "8": run(180.0), "2": run(70.0, good=None),
                                  "64": {"num_requests": 0, "num_errors": 128, "first_error": "HTTP 503", "output_tok_per_s": 0.0}}},
    }
    paths = {}
    for name, content in data.items():
        paths[name] = tmp_path / name
        paths[name].write_text(json.dumps(content))
    return paths


def _row(markdown: str, starts: str) -> list[str]:
    line = next(line for line in markdown.splitlines() if line.startswith(f"| {starts}"))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_report_tables_ratios_and_sources(files, tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "pyplot", lambda: None)  # the tables need no matplotlib
    out = tmp_path / "docs" / "benchmarks.md"
    markdown, written = report.render_report(list(files.values()), out, cpu_classes=["hf.json=avx2"])
    assert written == []
    assert "Plots need matplotlib" in markdown
    # W1/W2 by server, ratios to vLLM and to the naive baseline
    ours = _row(markdown, "this project (`continuous`)")
    assert ours[1] == "250.0" and ours[7] == "50.0"
    assert ours[9] == "0" and ours[10:14] == ["0.50x", "12.50x", "2.00x", "2.50x"]
    assert ours[5] == "1.50/s (94%)"
    assert ours[6] == "4096 / 4096" and _row(markdown, "vllm")[6] == "–"  # streamed chunks / tokens, where recorded
    # W5: what the streams paid while a long prompt arrived
    mixed = _row(markdown.split("(W5)", 1)[1], "this project (`continuous`)")
    assert mixed[1:7] == ["180", "180", "45", "1,905", "4.10", "2048 / 2048"]
    hf = _row(markdown, "transformers offline")
    assert hf[1] == "75.0" and hf[10] == "0.15x" and hf[11] == "3.75x" and hf[13] == "0.75x"
    # the seeds' table: ratios to the naive row of the same file
    assert _row(markdown, "dynamic batching")[6] == "5.00x"
    assert _row(markdown, "continuous batching")[6] == "6.25x"
    assert _row(markdown, "batched GPTQ 4-bit")[6] == "8.00x"
    # W3/W4, the sweep (levels in numeric order, a failed level), goodput
    assert "## Shared system prompt (W3) and rewrites (W4)" in markdown
    sweep = markdown[markdown.index("## Concurrency sweep"):markdown.index("## Goodput")]
    assert [r.split("|")[1].strip() for r in sweep.splitlines() if r.startswith("| ") and not r.startswith("| concurrency")] == ["1", "2", "8", "64"]
    assert "failed: HTTP 503" in sweep
    assert "not recorded (the file predates goodput)" in markdown
    # sources: command, times, CPU class recorded, given, or not recorded
    assert "AVX-512 with avx512_bf16 (avx2, avx512_bf16, avx512f)" in markdown
    assert "AVX2-only (no native bf16) (avx2) (given to the report; the file predates machine.cpu_class)" in markdown
    assert "`python -m app.bench peer --name vllm`" in markdown
    assert "2026-11-24 07:43:00 UTC to 07:50:00 UTC" in markdown
    assert "not recorded (made by `python -m app.bench hf`)" in markdown  # older files: what made them, said as such


def test_a_quant_run_without_its_own_naive_row_takes_the_compare_runs(files, tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "pyplot", lambda: None)
    gptq_only = json.loads(files["quant.json"].read_text())
    gptq_only["serving"].pop("naive fp32")
    files["quant.json"].write_text(json.dumps(gptq_only))
    markdown, _ = report.render_report([files["compare.json"], files["quant.json"]], tmp_path / "b.md")
    assert _row(markdown, "batched GPTQ 4-bit")[6] == "2.00x"  # 80 against compare's naive 40
    alone, _ = report.render_report([files["quant.json"]], tmp_path / "c.md")
    assert _row(alone, "batched GPTQ 4-bit")[6] == "–"


def test_report_without_peers_says_which_ratios_are_missing(files, tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "pyplot", lambda: None)
    markdown, _ = report.render_report([files["compare.json"]], tmp_path / "b.md")
    assert "No result for vLLM (`make bench-vllm`) or the naive baseline (`make bench-naive`)" in markdown
    assert _row(markdown, "this project (`continuous`)")[10] == "–"


def test_ratios_take_the_peer_of_the_same_sitting_and_model_only(files, tmp_path, monkeypatch):
    """A peer on another model, or measured in another folder, is no reference; several runs of a peer in one
    sitting give their median, per workload."""
    monkeypatch.setattr(plots, "pyplot", lambda: None)
    rounds = tmp_path / "alternated"
    rounds.mkdir()
    paths = []
    for name, model, figures in (("ours", "", (260.0, 40.0)), ("vllm", "", (250.0, 30.0)), ("vllm", "", (200.0, 50.0)),
                                 ("vllm", "", (300.0, 20.0)), ("vllm", "llama-371m", (1000.0, 1000.0))):
        path = rounds / f"{name}-{model or 'embedded'}-{len(paths)}.json"
        failed = {"num_errors": 3} if len(paths) == 1 else {}
        path.write_text(json.dumps({"peer": name, "model": model, "machine": MACHINE,
                                    "servers": {name: {"W1": {**run(figures[0]), **failed}, "W2": run(figures[1])}}}))
        paths.append(path)
    markdown, _ = report.render_report([files["compare.json"], files["hf.json"], files["peer-naive.json"], *paths], tmp_path / "b.md")
    hf = _row(markdown, "transformers offline")
    assert hf[10:14] == ["–", "3.75x", "–", "0.75x"]  # no vLLM in the hf run's folder; the naive run beside it
    ours = _row(markdown, "ours")
    assert ours[10:14] == ["1.04x", "–", "1.33x", "–"]  # vLLM's median W1 250 and W2 30 there; no naive in that folder
    assert _row(markdown, "vllm on llama-371m")[10:14] == ["1.00x", "–", "1.00x", "–"]
    assert _row(markdown, "vllm")[9] == "3"  # the failed requests of a run, beside its figures


def test_report_command_writes_markdown_and_plots(files, tmp_path):
    out = tmp_path / "docs" / "benchmarks.md"
    assert bench_main(["report", *map(str, files.values()), "--out", str(out)]) == 0
    markdown = out.read_text()
    for name in ("sweep-throughput.png", "sweep-latency.png", "w1-latency.png"):
        [plot] = (out.parent / "benchmarks").glob(f"*/{name}")  # in the CPU class's own folder
        assert plot.read_bytes()[:4] == b"\x89PNG"
        assert f"]({plot.relative_to(out.parent)})" in markdown
    assert markdown.startswith("# Benchmarks")
    assert "Generated by `python -m app.bench report " in markdown


def test_each_cpu_class_keeps_its_own_dated_section(files, tmp_path):
    out = tmp_path / "benchmarks.md"
    avx512 = [str(files[name]) for name in ("compare.json", "peer-vllm.json")]
    assert bench_main(["report", *avx512, "--out", str(out), "--no-plots"]) == 0
    avx2 = json.loads(files["peer-naive.json"].read_text())
    avx2["machine"] = {**MACHINE, "cpu_class": ["avx2"]}
    avx2["finished_utc"] = "2026-11-26 01:20:00 UTC"
    (tmp_path / "avx2.json").write_text(json.dumps(avx2))
    assert bench_main(["report", str(tmp_path / "avx2.json"), "--out", str(out), "--no-plots"]) == 0
    both = out.read_text()
    assert "## AVX2-only (no native bf16) (avx2): last run 2026-11-26 01:20 to 01:20 UTC" in both
    assert "## AVX-512 with avx512_bf16 (avx2, avx512_bf16, avx512f): last run 2026-11-24 07:43 to 07:50 UTC" in both
    assert both.count("## Workloads") == 1 and both.count("## CPU classes") == 1
    assert "- [AVX2-only (no native bf16) (avx2)](#avx2-only-no-native-bf16-avx2-last-run-2026-11-26-0120-to-0120-utc)" in both
    # the AVX-512 class again, with only vLLM this time: its section is replaced, the AVX2 one kept as it was
    assert bench_main(["report", str(files["peer-vllm.json"]), "--out", str(out), "--no-plots"]) == 0
    again = out.read_text()
    before, after = report._sections(both), report._sections(again)
    assert before.keys() == after.keys() and len(after) == 2
    avx2_key = next(key for key in after if key.startswith("AVX2"))
    avx512_key = next(key for key in after if key.startswith("AVX-512"))
    assert after[avx2_key] == before[avx2_key]
    assert "this project (`continuous`)" in before[avx512_key] and "this project (`continuous`)" not in after[avx512_key]


def test_alternated_runs_are_summarized_by_their_medians(files, tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "pyplot", lambda: None)
    paths = []
    for i, (ours, vllm) in enumerate([(200.0, 180.0), (240.0, 150.0), (220.0, 190.0)]):
        for name, tok_s in (("ours", ours), ("vllm", vllm)):
            runs = {"W1": {**run(tok_s), "output_tokens": 4096, "streamed_chunks": 4096}, "W2": run(tok_s / 8)}
            paths.append(tmp_path / f"{name}-{i}.json")
            paths[-1].write_text(json.dumps({"peer": name, "model": "smollm2-135m", "machine": MACHINE, "servers": {name: runs},
                                             "started_utc": f"2026-11-27 0{4 + i}:03:49 UTC"}))
    big = tmp_path / "ours-371m.json"
    big.write_text(json.dumps({"peer": "ours", "model": "llama-371m", "machine": MACHINE, "servers": {"ours": {"W1": run(90.0)}}}))
    markdown, _ = report.render_report([*paths, big], tmp_path / "b.md")
    medians = markdown.split("### Alternated runs: medians", 1)[1]
    ours = _row(medians, "ours")
    assert ours[1:3] == ["3", "220.0"] and ours[8] == "12288 / 12288" and ours[10] == "1.22x"  # 220 / median(180, 150, 190)
    assert ours[12] == "2026-11-27 04:03"  # the sitting: its first run's start
    assert _row(medians, "ours on llama-371m")[10] == "–"  # no vLLM run on that model: no ratio


def test_goodput_counts_requests_meeting_both_objectives():
    records = [{"ttft_s": 1.0, "itl_p99_ms": 150.0}, {"ttft_s": 2.5, "itl_p99_ms": 100.0},
               {"ttft_s": 0.5, "itl_p99_ms": 250.0}, {"ttft_s": 2.0, "itl_p99_ms": 200.0}]
    good = goodput(records, wall_s=4.0, slo_ttft_s=2.0, slo_itl_ms=200.0)
    assert good == {"slo_ttft_s": 2.0, "slo_itl_ms": 200.0, "good_requests": 2, "req_per_s": 0.5, "fraction": 0.5}
    assert goodput(records, 4.0, 2.0, 200.0, num_errors=4)["fraction"] == 0.25  # failures miss the SLO
    assert goodput([], 0.0, 2.0, 200.0) == {"slo_ttft_s": 2.0, "slo_itl_ms": 200.0, "good_requests": 0, "req_per_s": 0.0, "fraction": 0.0}


def test_summary_records_goodput_per_request():
    timings = [load.RequestTiming(ttft_s=0.5, e2e_s=2.0, prompt_tokens=10, output_tokens=4, itl_s=[0.1, 0.1, 0.3]),
               load.RequestTiming(ttft_s=3.0, e2e_s=4.0, prompt_tokens=10, output_tokens=4, itl_s=[0.1, 0.1, 0.1])]
    summary = load.summarize(load.LoadSpec(slo_ttft_s=2.0, slo_itl_ms=350.0), timings, wall_s=4.0)
    assert summary["requests"][0] == {"ttft_s": 0.5, "e2e_s": 2.0, "output_tokens": 4, "itl_p99_ms": 296.0, "itl_max_ms": 300.0}
    assert summary["goodput"]["good_requests"] == 1 and summary["goodput"]["fraction"] == 0.5
    assert load.summarize(load.LoadSpec(slo_itl_ms=200.0), timings[:1], 4.0)["goodput"]["good_requests"] == 0


def test_workloads():
    spec = load.LoadSpec(num_requests=32)
    path, bodies = load.make_requests(load.workload_spec("W3", spec))
    assert path == "/v1/chat/completions" and len(bodies) == 32
    systems = {b["messages"][0]["content"] for b in bodies}
    assert len(systems) == 1 and 330 <= len(next(iter(systems)).split()) <= 380  # one shared ~400-token prefix
    assert len({b["messages"][1]["content"] for b in bodies}) > 16  # questions differ
    path, bodies = load.make_requests(load.workload_spec("W4", spec))
    assert path == "/v1/chat/completions"
    assert all(any(p in b["messages"][0]["content"] for p in load.PASSAGES) for b in bodies)
    path, bodies = load.make_requests(load.workload_spec("W1", spec))
    assert path == "/v1/completions" and bodies[0]["prompt"] == load.make_prompts(spec)[0]
    w2 = load.workload_spec("W2", spec)
    assert (w2.num_requests, w2.concurrency, w2.workload) == (8, 1, "random")
    with pytest.raises(ValueError):
        load.workload_spec("W9", spec)


@pytest.fixture
def mock_server(monkeypatch):
    """Every request of the load generator answered by an in-process OpenAI-like stream; yields what was sent."""
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.path, body))
        if request.url.path == "/v1/chat/completions":
            chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}]
            chunks += [{"choices": [{"index": 0, "delta": {"content": f" t{i}"}}]} for i in range(body["max_tokens"])]
        else:
            chunks = [{"choices": [{"index": 0, "text": f" t{i}"}]} for i in range(body["max_tokens"])]
        chunks.append({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": body["max_tokens"]}})
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    real_client = httpx.AsyncClient
    monkeypatch.setattr(load.httpx, "AsyncClient", lambda **kw: real_client(transport=httpx.MockTransport(handler), **kw))
    return seen


def test_run_load_reads_chat_and_completion_streams(mock_server):
    """The whole client path: chat deltas and completion text both count as tokens."""
    seen = mock_server
    for name in ("W1", "W3", "W4"):
        spec = load.workload_spec(name, load.LoadSpec(num_requests=4, concurrency=2, max_tokens=5))
        result = asyncio.run(load.run_load(spec, progress="test"))
        assert result["num_requests"] == 4 and result["num_errors"] == 0, result
        assert result["output_tokens"] == 20 and result["mean_prompt_tokens"] == 7
        assert result["goodput"]["fraction"] == 1.0 and len(result["requests"]) == 4
    assert {path for path, _ in seen} == {"/v1/completions", "/v1/chat/completions"}
    assert all(b["ignore_eos"] and b["min_tokens"] == 5 and b["stream"] for _, b in seen)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_token_with_no_text_counts_as_streamed_and_the_opening_and_closing_chunks_do_not(path):
    """5 tokens, the third a special token left out of the text (an empty delta, as vLLM and this project stream
    it), between a chat stream's role announcement and a closing chunk with only the finish reason."""
    chat = path.endswith("chat/completions")

    def choice(text: str | None, finish: str | None = None, role: bool = False) -> dict:
        if chat:
            delta = {} if text is None else {"content": text, **({"role": "assistant"} if role else {})}
            return {"index": 0, "delta": delta, "finish_reason": finish}
        return {"index": 0, "text": text or "", "finish_reason": finish}

    chunks = ([choice("", role=True)] if chat else []) + [choice(t) for t in (" a", " b", "", " c", " d")]
    chunks += [choice(None, "length"), {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}}]
    stream = "".join(f"data: {json.dumps(c if 'usage' in c else {'choices': [c]})}\n\n" for c in chunks) + "data: [DONE]\n\n"

    async def one() -> load.RequestTiming:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, text=stream))
        async with httpx.AsyncClient(transport=transport, base_url="http://server") as http:
            return await load._stream_one(http, load.LoadSpec(max_tokens=5), path, {"prompt": "x"})

    timing = asyncio.run(one())
    assert (timing.chunks, timing.output_tokens, len(timing.itl_s)) == (5, 5, 3)  # gaps between the 4 texts a reader sees


@pytest.mark.parametrize("ending, error", [
    ("cut", "incomplete stream: 3 of 5 tokens, no [DONE]"),  # the connection closed mid-stream
    ("short", "incomplete stream: 3 of 5 tokens"),  # a server that stopped early and said so
    ("malformed", "malformed event"),
])
def test_a_stream_cut_short_or_malformed_fails_its_request_alone(ending, error, monkeypatch):
    """One bad stream among four is a failed request, counted; the other three are measured."""
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        broken = len(calls) == 2
        tokens = 3 if broken and ending != "malformed" else 5
        text = "".join(f"data: {json.dumps({'choices': [{'index': 0, 'text': f' t{i}'}]})}\n\n" for i in range(tokens))
        if broken and ending == "malformed":
            text += "data: {not json\n\n"
        text += f"data: {json.dumps({'choices': [], 'usage': {'prompt_tokens': 7, 'completion_tokens': tokens}})}\n\n"
        return httpx.Response(200, text=text if broken and ending == "cut" else text + "data: [DONE]\n\n")

    real_client = httpx.AsyncClient
    monkeypatch.setattr(load.httpx, "AsyncClient", lambda **kw: real_client(transport=httpx.MockTransport(handler), **kw))
    result = asyncio.run(load.run_load(load.LoadSpec(num_requests=4, concurrency=1, max_tokens=5)))
    assert (result["num_requests"], result["num_errors"], result["output_tokens"]) == (3, 1, 15)
    assert error in result["first_error"]


def test_percentiles_interpolate_between_the_closest_ranks():
    assert percentiles([4.0, 1.0, 3.0, 2.0])["p50"] == 2.5  # an even count: the middle two's mean
    assert percentiles([1.0, 2.0, 3.0])["p50"] == 2.0
    assert percentiles([float(v) for v in range(1, 12)])["p90"] == 10.0
    assert percentiles([0.0, 100.0])["p99"] == 99.0
    assert percentiles([7.0]) == {"p50": 7.0, "p90": 7.0, "p99": 7.0, "mean": 7.0}


def test_peer_and_sweep_commands_save_what_the_report_reads(mock_server, tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "pyplot", lambda: None)
    peer, sweep = tmp_path / "peer-vllm.json", tmp_path / "sweep.json"
    common = ["--url", "http://127.0.0.1:1", "--model", "m", "--max-tokens", "3", "--no-progress"]
    assert bench_main(["peer", "--name", "vllm", "--workloads", "W1", "W2", "--requests", "4", "--concurrency", "4", *common,
                       "--out", str(peer)]) == 0
    assert bench_main(["sweep", "--name", "ours", "--concurrencies", "1", "4", *common, "--out", str(sweep)]) == 0
    saved = json.loads(peer.read_text())
    assert saved["command"].startswith("python -m app.bench peer --name vllm") and saved["machine"]["cpu_class"] is not None
    assert saved["servers"]["vllm"]["W2"]["spec"]["concurrency"] == 1 and saved["servers"]["vllm"]["W1"]["num_requests"] == 4
    levels = json.loads(sweep.read_text())["levels"]
    assert {c: r["num_requests"] for c, r in levels.items()} == {"1": 8, "4": 8}
    assert all(r["goodput"]["fraction"] == 1.0 for r in levels.values())
    markdown, _ = report.render_report([peer, sweep], tmp_path / "b.md")
    assert _row(markdown, "vllm")[1] != "–" and "**ours** (random requests, m) [2]" in markdown


def test_the_mixed_workload_sends_the_long_prompt_once_every_stream_has_streamed(mock_server):
    spec = load.workload_spec("W5", load.LoadSpec(max_tokens=12))
    result = asyncio.run(load.run_mixed(spec))
    streams = [body for path, body in mock_server if body["max_tokens"] == 256]
    long = [body for path, body in mock_server if body["max_tokens"] == 16]
    assert len(streams) == load.MIXED_STREAMS and len(long) == 1
    assert mock_server.index(("/v1/completions", long[0])) == load.MIXED_STREAMS  # sent after the streams
    assert len(long[0]["prompt"].split()) == load.MIXED_LONG_PROMPT_WORDS + 2  # "Note <nonce>:" + the words
    second = asyncio.run(load.run_mixed(spec))
    assert result["num_errors"] == second["num_errors"] == 0
    assert [b for _, b in mock_server if b["max_tokens"] == 16][1]["prompt"] != long[0]["prompt"]  # no prefix cache hit
    assert result["num_requests"] == load.MIXED_STREAMS and result["streamed_chunks"] == result["output_tokens"] == 8 * 256
    assert result["mixed"]["long_prompt_tokens"] == 7 and result["mixed"]["stream_gap_max_ms"] >= 0


def test_a_sources_command_names_no_path_of_the_machine_it_ran_on():
    from app.bench.report_sources import portable

    command = ("python -m app.bench peer --out /work/main/results/bench/run-1/ours.json "
               "--model-source /root/.cache/llm-serve/bench-llama-371m-seed0 --other results/bench/x.json")
    assert portable(command) == ("python -m app.bench peer --out results/bench/run-1/ours.json "
                                 "--model-source $LLM_SERVE_CACHE/bench-llama-371m-seed0 --other results/bench/x.json")


def test_each_phase_of_a_run_sends_prompts_of_its_own():
    """A server keeps what it computed for earlier phases: a phase repeating another's prompts would be served from
    the prefix cache of a server whose blocks are smaller than a prompt (ours), not of one whose are larger (vLLM)."""
    from app.bench.load import PHASE_SEEDS, LoadSpec, make_prompts, workload_spec

    spec = LoadSpec()
    phases = {name: set(make_prompts(workload_spec(name, spec))) for name in ("W1", "W2", "W5")}
    phases["warm-up"] = set(make_prompts(LoadSpec(num_requests=2, seed=spec.seed + PHASE_SEEDS["warm-up"])))
    phases["sweep"] = set(make_prompts(LoadSpec(num_requests=8, seed=spec.seed + PHASE_SEEDS["sweep"] + 1)))
    seen = [prompt for prompts in phases.values() for prompt in prompts]
    assert len(seen) == len(set(seen)) == 32 + 8 + 8 + 2 + 8
    assert make_prompts(workload_spec("W1", spec)) == make_prompts(spec)  # W1 as it always was

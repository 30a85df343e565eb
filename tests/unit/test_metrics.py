"""Serving metrics: histograms, a request's clock, and the Prometheus text they render to."""

import re

from app.metrics import Histogram, RequestMetrics, RequestTiming, render

VALUE = r'"(?:[^"\\]|\\.)*"'  # a label value: escaped quotes and backslashes allowed
SAMPLE = re.compile(rf'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{{[a-z_]+={VALUE}(,[a-z_]+={VALUE})*\}})? -?[0-9.e+-]+$|^# TYPE \S+ (gauge|counter|histogram)$')


def test_a_histogram_counts_each_value_in_the_first_bucket_that_holds_it():
    histogram = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):
        histogram.observe(value)
    assert histogram.counts == [2, 1, 1] and histogram.count == 4 and abs(histogram.total - 3.65) < 1e-9


def test_a_request_clock_gives_ttft_inter_token_gaps_and_e2e():
    metrics = RequestMetrics()
    timing = RequestTiming(arrival_s=10.0, prompt_tokens=7, sink=metrics)
    timing.tokens(10.5, 1)  # TTFT 0.5
    timing.tokens(10.6, 1)
    timing.tokens(10.9, 3)  # a chunk of 3 (accepted drafts): one engine step, one gap of 0.3 s (vLLM's)
    timing.finish(11.0, "length")
    timing.phase_times = {"queue_s": 0.125, "prefill_s": 0.25, "decode_s": 0.5}  # as the engine reports them
    metrics.record(timing)
    data = metrics.to_dict()
    assert data["time_to_first_token_seconds"]["count"] == 1 and abs(data["time_to_first_token_seconds"]["sum"] - 0.5) < 1e-9
    assert data["inter_token_latency_seconds"]["count"] == 2  # 3 outputs: 2 gaps after the first
    assert abs(data["inter_token_latency_seconds"]["sum"] - 0.4) < 1e-9
    tpot = data["request_time_per_output_token_seconds"]  # the decode's 0.4 s over the 4 tokens after the first
    assert tpot["count"] == 1 and abs(tpot["sum"] - 0.1) < 1e-9
    assert abs(data["e2e_request_latency_seconds"]["sum"] - 1.0) < 1e-9
    assert (data["prompt_tokens"], data["generation_tokens"]) == (7, 5) and data["request_success"]["length"] == 1
    for key, seconds in (("queue", 0.125), ("prefill", 0.25), ("decode", 0.5)):
        assert data[f"request_{key}_time_seconds"]["sum"] == seconds and data[f"request_{key}_time_seconds"]["count"] == 1


def test_a_running_request_shows_in_the_rates_and_latencies_before_it_ends():
    """A long stream's tokens and a stalled one's latencies reach /metrics as they happen (vLLM's, per step), not as
    one jump when the request ends (a stall would read healthy until then)."""
    metrics = RequestMetrics()
    timing = RequestTiming(arrival_s=0.0, prompt_tokens=9, sink=metrics)
    assert (metrics.prompt_tokens, metrics.ttft.count) == (0, 0)
    timing.tokens(2.0, 1)
    assert (metrics.prompt_tokens, metrics.generation_tokens, metrics.ttft.count, metrics.ttft.total) == (9, 1, 1, 2.0)
    timing.tokens(6.0, 2)  # a 4 s stall, seen while the request runs on
    assert (metrics.generation_tokens, metrics.inter_token.count, metrics.inter_token.total) == (3, 1, 4.0)
    assert metrics.e2e.count == 0 and sum(metrics.finished.values()) == 0


def test_a_paced_chunk_of_several_steps_spreads_its_gap_over_them():
    """stream_interval_ms folds steps into one chunk: the figure stays the engine's per step, not the chunk's."""
    metrics = RequestMetrics()
    timing = RequestTiming(arrival_s=0.0, prompt_tokens=3, sink=metrics)
    timing.tokens(0.1, 1)
    timing.tokens(0.2, 5, steps=5)  # a token every 20 ms, sent as one chunk
    assert metrics.inter_token.count == 5 and abs(metrics.inter_token.total - 0.1) < 1e-9


def test_every_reason_is_a_series_from_the_start():
    """Prometheus sees no rise in a series' first sample: the first error after a restart must move a series at 0."""
    lines = render({"m": {"requests": RequestMetrics().to_dict()}}).splitlines()
    for reason in ("stop", "length", "abort", "error"):
        assert f'llm_serve:request_success_total{{model_name="m",finished_reason="{reason}"}} 0.0' in lines
    for reason in ("overloaded", "draining", "stopped", "queue_timeout"):
        assert f'llm_serve:request_rejected_total{{model_name="m",reason="{reason}"}} 0.0' in lines


def test_render_writes_valid_prometheus_text_with_cumulative_buckets_per_model():
    requests = RequestMetrics()
    timing = RequestTiming(0.0, 3, requests)
    timing.tokens(0.2, 2)
    timing.finish(0.3, "stop")
    requests.record(timing)
    engine = {"num_running": 2, "num_waiting": 1, "kv_usage": 0.25, "prefix_cache_hit_tokens": 16, "spec_num_drafts": 4,
              "spec_num_accepted_tokens_per_pos": [3, 1], "step_tokens": Histogram((1, 2, 4)).to_dict()}
    text = render({'a"b': {"requests": requests.to_dict(), "engine": engine}, "m2": {"requests": {}}})
    lines = text.strip().splitlines()
    assert all(SAMPLE.match(line) for line in lines), [line for line in lines if not SAMPLE.match(line)]
    assert 'llm_serve:num_requests_running{model_name="a\\"b"} 2.0' in lines
    assert 'llm_serve:request_success_total{model_name="a\\"b",finished_reason="stop"} 1.0' in lines
    assert 'llm_serve:spec_decode_num_accepted_tokens_per_pos_total{model_name="a\\"b",position="1"} 1.0' in lines
    ttft = [line for line in lines if line.startswith("llm_serve:time_to_first_token_seconds_bucket")]
    counts = [float(line.rsplit(" ", 1)[1]) for line in ttft]
    assert counts == sorted(counts) and counts[-1] == 1.0 and ttft[-1].endswith('le="+Inf"} 1.0')
    assert sum(line.startswith("# TYPE llm_serve:num_requests_running ") for line in lines) == 1  # one family header


def test_a_first_chunk_of_several_tokens_adds_no_zero_gaps():
    """A consumer that fell behind gets its first tokens merged into one chunk: they came with TTFT, so they have no
    gap of their own to show (counted as 0 s, they would pull the inter-token percentiles to nothing)."""
    metrics = RequestMetrics()
    timing = RequestTiming(arrival_s=0.0, prompt_tokens=3, sink=metrics)
    timing.tokens(0.5, 3)
    timing.tokens(0.55, 1)
    timing.tokens(0.6, 1)
    timing.finish(0.6, "length")
    metrics.record(timing)
    itl = metrics.to_dict()["inter_token_latency_seconds"]
    assert itl["count"] == 2 and abs(itl["sum"] - 0.1) < 1e-9
    assert metrics.generation_tokens == 5


def test_queue_and_prefill_times_of_milliseconds_land_in_their_own_buckets():
    metrics = RequestMetrics()
    timing = RequestTiming(0.0, 3)
    timing.tokens(0.04, 1)
    timing.finish(0.1, "stop")
    timing.phase_times = {"queue_s": 0.002, "prefill_s": 0.035, "decode_s": 0.06}
    metrics.record(timing)
    for key, bound in (("request_queue_time_seconds", 0.0025), ("request_prefill_time_seconds", 0.05)):
        histogram = metrics.to_dict()[key]
        assert histogram["counts"][histogram["buckets"].index(bound)] == 1  # not all in a first bucket of 0.3 s


def test_rejected_requests_are_their_own_counter():
    metrics = RequestMetrics()
    for reason in ("overloaded", "overloaded", "draining"):
        metrics.record_rejection(reason)
    data = metrics.to_dict()
    assert data["request_rejected"] == {"overloaded": 2, "draining": 1, "stopped": 0, "queue_timeout": 0}
    assert data["e2e_request_latency_seconds"]["count"] == 0
    lines = render({"m": {"requests": data}}).splitlines()
    assert 'llm_serve:request_rejected_total{model_name="m",reason="overloaded"} 2.0' in lines
    assert all(SAMPLE.match(line) for line in lines)


async def test_served_figures_leave_out_refusals_and_names_this_model_does_not_serve():
    """Through the real serving layer on the fake model: a request refused at the door (overloaded) is in no
    latency or token figure (a failure in the engine is: it was served); a name this model does not serve
    (a handle call) is counted under the model's own."""
    import asyncio

    from app.api.protocol import CompletionRequest
    from app.config import AppConfig
    from app.engine import EngineOverloadedError
    from tests.serve.fake_model import fake_model_server

    engine = {"separate_process": False, "max_num_seqs": 1, "max_queued_requests": 1, "max_batch_size": 1}
    server = fake_model_server(AppConfig.from_args({"models": [{"model": {"source": "fake-a"}, "engine": engine}]}).models[0])

    async def one(prompt: str, model: str = "fake-a"):
        try:
            await server.serving.completion(CompletionRequest(model=model, prompt=prompt, max_tokens=4))
        except Exception as exc:  # noqa: BLE001 - what each ended with
            return type(exc)
        return None

    try:
        outcomes = await asyncio.gather(*(one("hello") for _ in range(5)))
        failed = await one("fail-after-2")
        await one("hello", model="a-typo")
    finally:
        server.shutdown(1)
    refused = outcomes.count(EngineOverloadedError)
    assert refused >= 1 and failed is not None
    data = server.metrics()["fake-a"]["requests"]
    served = len(outcomes) - refused + 2
    assert data["request_rejected"] == {"overloaded": refused, "draining": 0, "stopped": 0, "queue_timeout": 0}
    assert data["e2e_request_latency_seconds"]["count"] == served and sum(data["request_success"].values()) == served
    assert data["request_success"]["error"] == 1
    assert set(server.serving.metrics) == {"fake-a"}


async def test_a_queue_timeout_is_a_refusal_after_its_wait_not_an_engine_error():
    """Requests that waited engine.max_queue_time_s without a first token (503s under overload) are counted with
    the refusals and their wait is in the queue figure; as engine errors they would page whoever watches errors."""
    import asyncio

    from app.api.protocol import CompletionRequest
    from app.config import AppConfig
    from app.engine.errors import EngineQueueTimeoutError
    from tests.serve.fake_model import fake_model_server

    engine = {"separate_process": False, "max_num_seqs": 1, "max_queued_requests": 4, "max_queue_time_s": 0.3}
    server = fake_model_server(AppConfig.from_args({"models": [{"model": {"source": "fake-a"}, "engine": engine}]}).models[0])

    async def one(max_tokens: int):
        try:
            await server.serving.completion(CompletionRequest(model="fake-a", prompt="hello", max_tokens=max_tokens))
        except Exception as exc:  # noqa: BLE001 - what each ended with
            return type(exc)
        return None

    try:
        long = asyncio.ensure_future(one(60))  # ~1.2 s of steps, alone in the one-sequence batch
        await asyncio.sleep(0.05)
        outcomes = await asyncio.gather(*(one(2) for _ in range(2))) + [await long]
    finally:
        server.shutdown(1)
    assert outcomes == [EngineQueueTimeoutError, EngineQueueTimeoutError, None]
    data = server.metrics()["fake-a"]["requests"]
    assert data["request_rejected"] == {"overloaded": 0, "draining": 0, "stopped": 0, "queue_timeout": 2}
    assert data["request_success"] == {"stop": 0, "length": 1, "abort": 0, "error": 0}
    waited = data["request_queue_time_seconds"]  # the fake engine reports no phases: the two waits alone
    assert waited["count"] == 2 and 0.6 <= waited["sum"] < 1.2 and data["e2e_request_latency_seconds"]["count"] == 1


async def test_a_prompt_counts_once_however_many_choices_it_has_as_in_the_usage():
    from app.api.protocol import CompletionRequest
    from app.config import AppConfig
    from tests.serve.fake_model import fake_model_server

    server = fake_model_server(AppConfig.from_args({"models": [{"model": {"source": "fake-a"}, "engine": {"separate_process": False}}]}).models[0])
    try:
        answer = await server.serving.completion(CompletionRequest(model="fake-a", prompt=["hello", "hi there"], n=3, max_tokens=2))
    finally:
        server.shutdown(1)
    data = server.metrics()["fake-a"]["requests"]
    assert len(answer["choices"]) == 6 and data["prompt_tokens"] == answer["usage"]["prompt_tokens"]
    assert data["generation_tokens"] == answer["usage"]["completion_tokens"] == 12


async def test_closing_a_stream_of_several_choices_ends_every_choice_at_once():
    """n = 3 streamed, the client leaves after 4 chunks: all three engine requests end with the close, not when
    the garbage collector finds the merged stream."""
    from app.api.protocol import CompletionRequest, parse_body
    from app.config import AppConfig
    from tests.serve.fake_model import fake_model_server

    server = fake_model_server(AppConfig.from_args({"models": [{"model": {"source": "fake-a"}, "engine": {"separate_process": False}}]}).models[0])
    try:
        stream = server.serving.completion_stream(parse_body({"model": "fake-a", "prompt": "hello", "n": 3, "max_tokens": 500,
                                                              "stream": True}, CompletionRequest))
        for _ in range(4):
            await anext(stream)
        await stream.aclose()
        assert server.engine.num_unfinished == 0
    finally:
        server.shutdown(1)

"""Small fake engine cores for serving-layer tests (importable by a spawned engine process too)."""

import os

from app.engine.request import RequestOutput


class CountingCore:
    """Emits one token per step per request; 'fail' in the id makes that request fail."""

    def __init__(self):
        self.requests, self.aborted = {}, []

    @property
    def num_running(self):
        return len(self.requests)

    num_waiting = 0

    def add_requests(self, requests):
        for request in requests:
            self.requests[request.request_id] = request

    def stats(self):
        return {"num_running": self.num_running}

    def abort_request(self, request_id):
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def idle_wait_s(self):
        return 0.0

    def take_draft_calls(self):
        return []

    def add_draft_results(self, results):
        raise AssertionError("this core sends no draft calls")

    def step(self):
        outputs = []
        for rid, request in list(self.requests.items()):
            request.output_token_ids.append(len(request.output_token_ids))
            done = request.num_output_tokens >= request.sampling.max_tokens
            failed = "fail" in rid
            if done or failed:
                del self.requests[rid]
            outputs.append(
                RequestOutput(rid, [request.output_token_ids[-1]], "x", 1, request.num_output_tokens,
                              finished=done or failed, finish_reason="error" if failed else ("length" if done else None))
            )
        return outputs


class DyingCore(CountingCore):
    """A core whose process dies in the middle of a step (as an OOM kill would end it)."""

    def step(self):
        os._exit(3)


class RaisingCore(CountingCore):
    """A core whose step raises (a bug in the engine loop itself, outside any one request)."""

    def step(self):
        raise ValueError("step broke")


def build_counting_core():
    return CountingCore(), "counting-core-info"


def build_dying_core():
    return DyingCore(), "dying-core-info"


def build_raising_core():
    return RaisingCore(), "raising-core-info"


def in_thread(make_core=CountingCore):
    """A core built by ``make_core`` on an engine thread of this process, as ``separate_process: false`` runs it."""
    from app.engine.core_process import ThreadCore

    return ThreadCore(lambda: (make_core(), None))


async def until(condition, timeout_s=10.0):
    """Wait until ``condition()`` holds (checked between event-loop turns); fail after ``timeout_s``."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def build_broken_core():
    raise RuntimeError("weights missing")


def build_forever_loading_core():
    """A model load that never ends (a stalled download, a device that does not answer)."""
    import time

    time.sleep(3600)


class SlowCountingCore(CountingCore):
    """A CountingCore whose steps take 5 ms, like a (very fast) model."""

    def step(self):
        import time

        time.sleep(0.005)
        return super().step()


class QueueingCore(SlowCountingCore):
    """Runs at most ``max_running`` requests at a time, in arrival order (as max_num_seqs bounds the real
    engine's batch); the others wait for a place."""

    def __init__(self, max_running=1):
        super().__init__()
        self.max_running = max_running

    @property
    def num_running(self):
        return min(len(self.requests), self.max_running)

    @property
    def num_waiting(self):
        return len(self.requests) - self.num_running

    def stats(self):
        return {"num_running": self.num_running, "num_waiting": self.num_waiting}

    def step(self):
        import time

        time.sleep(0.005)
        running = dict(list(self.requests.items())[:self.max_running])
        waiting = {rid: request for rid, request in self.requests.items() if rid not in running}
        self.requests = running
        outputs = CountingCore.step(self)
        self.requests.update(waiting)
        return outputs


class WedgingCore(CountingCore):
    """Its steps hang for good once a request named "wedge" has had a token: a core that reads no command again."""

    def step(self):
        import time

        if getattr(self, "wedged", False):
            time.sleep(3600)
        self.wedged = "wedge" in self.requests
        return super().step()


def build_wedging_core():
    return WedgingCore(), "wedging-core-info"

"""A tiny fake model behind the real serving code, for fast Ray Serve tests.

``fake_model_server`` is a ``server_factory`` for deployments/builder.py: each replica runs the real
ModelServer, AsyncEngine (with the replica's @serve.batch window) and OpenAIServing; only the model
is fake. Its tokenizer gives one token per UTF-8 byte and its engine core echoes the prompt, one
byte per step, cycling through it until ``max_tokens``: a completion's text is therefore known in
advance (``echo``), and a long answer takes long enough to cancel.

A prompt can ask for trouble, to test what failures look like to clients:
- ``crash-tokenizer``: the tokenizer raises RuntimeError(SECRET) while the request is prepared;
- ``fail-after-2``: after two tokens the engine fails the request with that exception's text, as
  LLMEngine does when a forward pass raises;
- ``kill-replica-after-2``: after two tokens the replica's process exits (as an OOM kill ends it);
- ``wedge-engine``: after two tokens the engine's step never returns (a hung kernel or device): every
  request of that engine stops, and only the health check's step bound notices (``WEDGE_RELEASE``
  lets a test's own process go on).

A model whose name contains ``slow-warmup`` loads and warms up until its test releases it (``warmup_release``: a
file this machine's processes all see), or ``SLOW_WARMUP_S`` at most (readiness tests).

A model with a ``drafter: model`` (``DraftingEchoCore``) asks its draft model, another fake, for proposals
through the real path (the front's draft calls, Serve handles, the draft replica's ``propose``) and emits
those that match its own next bytes: its text never depends on the drafts, only how many steps it takes.
"""

import os
import pathlib
import tempfile
import threading
import time

from app.config import ServedModelConfig
from app.engine.core_process import CoreInfo
from app.engine.request import RequestOutput, TokenLogprob
from app.server import ModelServer
from app.spec.remote import DraftCall
from tests.unit.fakes import CountingCore

STEP_S = 0.02  # a small model's decode step: long answers stay cancellable, and a stream costs little CPU
MAX_MODEL_LEN = 1_000_000  # room for answers far longer than any test waits for
EOS_TOKEN_ID = 0  # never in a test prompt, so the echo only stops at max_tokens
SECRET = "secret internal detail"  # an exception's text, which must never reach a client
TROUBLE_AFTER_TOKENS = 2
WEDGE_RELEASE = threading.Event()  # set: a wedged step returns (only within this process)
SLOW_WARMUP_S = 60.0
MAX_DRAFT_WAIT_S = 0.5  # how long a drafting sequence waits for its draft model's answer


REPLAY = (b"<<replay>>", b"<</replay>>")  # a prompt holding a recorded answer between these gets that answer


def replayed(prompt: list[int]) -> list[int] | None:
    """The recorded answer a prompt asks the fake model to give (then it stops, as at EOS), or None: the echo."""
    text = bytes(prompt)
    start, end = text.find(REPLAY[0]), text.find(REPLAY[1])
    if start < 0 or end <= start + len(REPLAY[0]):
        return None
    return list(text[start + len(REPLAY[0]) : end])


def echo(prompt: str, max_tokens: int) -> str:
    """What the fake model answers to ``prompt`` (ASCII) given ``max_tokens``."""
    return (prompt * (max_tokens // len(prompt) + 1))[:max_tokens]


class ByteTokenizer:
    """One token per UTF-8 byte; the chat template writes one "role: content" line per message."""

    chat_template = "role: content lines"  # OpenAIServing only checks that there is one

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if "crash-tokenizer" in text:
            raise RuntimeError(SECRET)
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return [bytes([token]).decode("latin-1") for token in token_ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool, tokenize: bool,
                            continue_final_message: bool = False, **variables) -> str:
        """The last line is left open either way; variables (chat_template_kwargs) it reads none of, as most templates."""
        lines = [f"{message['role']}: {message['content']}" for message in messages]
        return "\n".join(lines + (["assistant:"] if add_generation_prompt else []))


class EchoCore(CountingCore):
    """An engine core that answers each request with its own prompt, one byte per step.

    As the real engine, it runs at most ``max_running`` requests (engine.max_num_seqs) at a time, in arrival
    order; the others wait for a place.
    """

    def __init__(self, max_running: int = 64) -> None:
        super().__init__()
        self.num_finished = 0
        self.max_running = max_running

    @property
    def num_running(self) -> int:
        return min(len(self.requests), self.max_running)

    @property
    def num_waiting(self) -> int:
        return len(self.requests) - self.num_running

    def stats(self) -> dict:
        return {"num_running": self.num_running, "num_waiting": self.num_waiting, "num_finished": self.num_finished,
                "num_aborted": len(self.aborted)}

    def step(self) -> list[RequestOutput]:
        time.sleep(STEP_S)
        return [self._next_byte(request) for request in list(self.requests.values())[:self.max_running]]

    def _next_byte(self, request) -> RequestOutput:
        prompt = request.prompt_token_ids
        if request.num_output_tokens == TROUBLE_AFTER_TOKENS:
            trouble = self._trouble(request)
            if trouble is not None:
                return trouble
        recorded = replayed(prompt)
        source = recorded or prompt
        token = source[request.num_output_tokens % len(source)]
        request.output_token_ids.append(token)
        # as the real engine's stop tokens, from the first token after min_tokens (stop strings: the real engine's alone)
        stopped = token in request.sampling.stop_token_ids and request.num_output_tokens > request.sampling.min_tokens
        ended = stopped or recorded is not None and request.num_output_tokens >= len(recorded)
        done = ended or request.num_output_tokens >= request.sampling.max_tokens
        if done:
            del self.requests[request.request_id]
            self.num_finished += 1
        text = bytes([token]).decode("utf-8", errors="replace")
        # a made-up logprob per token (its position's), so answers can be checked to carry each one
        logprobs = None if request.sampling.logprobs is None else [TokenLogprob(token, -request.num_output_tokens / 100)]
        return RequestOutput(
            request.request_id, [token], text, request.num_prompt_tokens, request.num_output_tokens,
            finished=done, finish_reason=("stop" if ended else "length") if done else None, logprobs=logprobs,
            stop_reason=token if stopped else None,
        )

    def _trouble(self, request) -> RequestOutput | None:
        prompt = bytes(request.prompt_token_ids)
        if b"kill-replica-after-2" in prompt:
            os._exit(1)
        if b"wedge-engine" in prompt:
            WEDGE_RELEASE.wait()  # forever, unless a test in this process releases it
            return None
        if b"fail-after-2" not in prompt:
            return None
        del self.requests[request.request_id]
        error = f"RuntimeError: {SECRET}"  # as LLMEngine.step reports a forward pass that raised
        return RequestOutput(
            request.request_id, [], "", request.num_prompt_tokens, request.num_output_tokens,
            finished=True, finish_reason="error", error=error,
        )


class DraftingEchoCore(EchoCore):
    """EchoCore whose sequences ask a draft model for ``num_tokens`` proposals after their output (one call in
    flight per sequence) and emit, beside the step's own byte, the proposals that are their next bytes. As the
    real engine, a sequence waits for its call up to ``MAX_DRAFT_WAIT_S``, then steps on without it: a lost
    call costs time, never a byte."""

    def __init__(self, max_running: int, drafters: dict[int, int]) -> None:
        super().__init__(max_running)
        self.drafters = drafters  # drafter index -> proposals per call, for each ``drafter: model``
        self.calls: list[DraftCall] = []  # for the front to send
        self.asked: dict[str, tuple[int, float]] = {}  # sequence id -> (output length assumed, when asked)
        self.proposals: dict[str, tuple[int, list[int]]] = {}  # sequence id -> (first position, proposals)
        self.num_calls = 0
        self.spec = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "num_failed_calls": 0}

    def stats(self) -> dict:
        return {**super().stats(), **{f"spec_{key}": value for key, value in self.spec.items()}}

    def take_draft_calls(self) -> list:
        calls, self.calls = self.calls, []
        return calls

    def add_draft_results(self, results: list) -> None:
        for result in results:
            assumed, _ = self.asked.pop(result.sequence_id, (None, 0.0))
            if result.error is not None:
                self.spec["num_failed_calls"] += 1
            elif assumed is not None and result.sequence_id in self.requests:
                self.spec["num_drafts"] += 1
                self.spec["num_draft_tokens"] += len(result.token_ids)
                self.proposals[result.sequence_id] = (assumed, list(result.token_ids))

    def idle_wait_s(self) -> float:
        """While every running sequence waits for its draft: until the first one's wait runs out."""
        waits = [self._wait_left_s(request) for request in self._running()]
        return min(waits) if waits and min(waits) > 0 else 0.0

    def step(self) -> list[RequestOutput]:
        time.sleep(STEP_S)
        outputs = []
        for request in self._running():
            if self._wait_left_s(request) > 0:
                continue
            output = self._next_byte(request)
            while request.request_id in self.requests and self._next_is_proposed(request):
                output = output.followed_by(self._next_byte(request))  # a verified proposal: one more byte now
                self.spec["num_accepted_tokens"] += 1
            if request.request_id in self.requests:
                self._ask(request)
            outputs.append(output)
        return outputs

    def _running(self) -> list:
        return list(self.requests.values())[:self.max_running]

    def _wait_left_s(self, request) -> float:
        asked = self.asked.get(request.request_id)
        return 0.0 if asked is None else asked[1] + MAX_DRAFT_WAIT_S - time.monotonic()

    def _next_is_proposed(self, request) -> bool:
        """Whether the draft proposed this sequence's next byte (proposals for positions it went past while the
        call was out are stale)."""
        first, proposals = self.proposals.get(request.request_id, (0, []))
        position = request.num_output_tokens
        if not first <= position < first + len(proposals):
            self.proposals.pop(request.request_id, None)
            return False
        if proposals[position - first] == request.prompt_token_ids[position % len(request.prompt_token_ids)]:
            return True
        self.proposals.pop(request.request_id)  # the later proposals followed the rejected one
        return False

    def _ask(self, request) -> None:
        num_tokens = self.drafters.get(request.drafter)
        if num_tokens is None or request.request_id in self.asked or request.request_id in self.proposals:
            return
        self.num_calls += 1
        self.asked[request.request_id] = (request.num_output_tokens, time.monotonic())
        self.calls.append(DraftCall(self.num_calls, request.drafter, request.request_id, list(request.prompt_token_ids),
                                    list(request.output_token_ids), num_tokens, request.sampling))

    def abort_request(self, request_id):
        self.asked.pop(request_id, None)
        self.proposals.pop(request_id, None)
        return super().abort_request(request_id)


def warmup_release(model_name: str) -> pathlib.Path:
    """The file whose existence ends ``model_name``'s slow warm-up."""
    return pathlib.Path(tempfile.gettempdir()) / f"llm-serve-test-{model_name}.release"


def build_fake_core(config: ServedModelConfig) -> tuple[EchoCore, CoreInfo]:
    if "slow-warmup" in config.model.name:  # as loading weights and the warm-up generation take time
        deadline = time.monotonic() + SLOW_WARMUP_S
        while not warmup_release(config.model.name).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    tokenizer = ByteTokenizer()
    info = CoreInfo(config.model.name, tokenizer, MAX_MODEL_LEN, frozenset({EOS_TOKEN_ID}), 256, 0.0)
    drafters = {i: spec.num_speculative_tokens for i, spec in enumerate(config.engine.drafters) if spec.drafter == "model"}
    if drafters:
        return DraftingEchoCore(config.engine.max_num_seqs, drafters), info
    return EchoCore(config.engine.max_num_seqs), info


def fake_model_server(config: ServedModelConfig, admit=None, draft_client=None) -> ModelServer:
    """The ``server_factory`` the fake app names: the real ModelServer on the fake model."""
    return ModelServer(config, admit, build_core=build_fake_core, draft_client=draft_client)

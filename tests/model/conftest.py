import dataclasses
import weakref

import pytest
import torch

from app.config import EngineConfig, ModelConfig, ServedModelConfig
from app.engine import LLMEngine, Request, SamplingParams
from app.models import load_model
from app.server import ModelServer
from app.cpu.ops import unavailable_reason
from tests.conftest import TEST_DEVICE, TORCH_THREADS
from tests.prompts import PROMPTS  # noqa: F401 (the model tier's tests import it from here)
from tests.model.references import keeping_transformers_copy, transformers_model  # noqa: F401 (as PROMPTS)


# A served engine's KV pool in the tests: one whole context of the embedded model (8,192 tokens, 360 MiB in fp32),
# which the tests' few sequences never fill. The default, 1 GiB on a CPU, took 1.9 s of CPU to zero at each start
# (2-core AVX2 EPYC); this one ~0.7 s.
SERVED_KV_MB = 400


@pytest.fixture(scope="session")
def server_fp32():
    """The real embedded model in fp32 (exact comparisons), behind the real engine, batch-invariant; its start runs
    the load-time parity check (engine.parity_check, on by default) and fails if the check does."""
    # 256-token steps: the warm-up runs one step of the whole budget, in fp32
    engine = EngineConfig(max_num_batched_tokens=256, batch_invariant=True, torch_threads=TORCH_THREADS,
                          kv_cache_memory_mb=SERVED_KV_MB)
    server = ModelServer(ServedModelConfig(model=ModelConfig(dtype="float32"), engine=engine))
    yield server
    server.shutdown(timeout_s=5)


@pytest.fixture(scope="session")
def loaded_fp32():
    """The fp32 model in the test process, for references and for engines a test steps synchronously."""
    return keeping_transformers_copy(load_model(ModelConfig(dtype="float32")))


@pytest.fixture(scope="session")
def loaded_rounded():
    """The embedded model with its Linear weights rounded to bf16 and held in fp32 (activations, KV and every sum
    stay fp32), for the engine's equality tests: transformers runs these very numbers, so equality with it is as
    exact as on the checkpoint's own weights; our kernel keeps bf16-exact weights as bf16 panels, so a decode
    step streams half the bytes. The checkpoint's own fp32 weights: ``loaded_fp32``, ``server_fp32``."""
    loaded = load_model(ModelConfig(dtype="float32"))
    with torch.no_grad():
        for module in loaded.model.modules():
            if type(module) is torch.nn.Linear:  # the head too (tied: the embedding with it)
                module.weight.copy_(module.weight.bfloat16().float())
    return keeping_transformers_copy(loaded)


def our_kernels_compute() -> bool:
    """Whether our CPU kernels compute the model tier's engines: a position's row then has the same bits in any step."""
    return TEST_DEVICE == "cpu" and unavailable_reason() is None


TEST_MAX_MODEL_LEN = 2048  # room for every prompt and answer of these tests; each engine zeroes a KV pool this long


def make_engine(loaded, max_model_len: int | None = None, **engine_fields) -> LLMEngine:
    """An engine over already-loaded weights; a small KV pool unless the test asks otherwise. Batch-invariant unless
    the test asks otherwise: the equality tests compare a row's bits alone and among batch-mates."""
    engine_fields.setdefault("batch_invariant", True)
    max_model_len = max_model_len or min(loaded.max_model_len, TEST_MAX_MODEL_LEN)
    if max_model_len != loaded.max_model_len:
        loaded = dataclasses.replace(loaded, max_model_len=max_model_len)
    engine_fields.setdefault("num_kv_blocks", max(loaded.max_model_len // 16, 64) + 64)
    return LLMEngine(loaded, EngineConfig(**engine_fields))


def greedy(max_tokens: int, **fields) -> SamplingParams:
    """Exactly ``max_tokens`` greedy tokens with EOS masked, as generate's min_new_tokens does."""
    return SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0, **fields)


def run_engine(engine: LLMEngine, requests: list[Request], group: bool = True) -> dict[str, list[int]]:
    """Step the engine until every request finishes; returns output token ids by request id."""
    if group:
        engine.add_requests(requests)
    else:
        for request in requests:
            engine.add_request(request)
    while engine.has_unfinished_requests():
        engine.step()
    return {r.request_id: list(r.output_token_ids) for r in requests}


PARITY_TOKENS = 16  # the length of the fp32 greedy runs the parity and fallback tests compare with transformers
_GREEDY_CHOICES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(prompt, tokens): choices}


def hf_greedy_divergence(loaded, prompt_ids: list[int], tokens: list[int], length: int) -> str | None:
    """None when ``tokens`` is what transformers' greedy generate gives for ``prompt_ids`` (``length`` tokens, EOS
    masked as min_new_tokens masks it); else where the two part. Teacher-forced: one forward of transformers' own
    model over the prompt and ``tokens``, whose choice at each position is greedy decoding's by definition, where
    generate would run a forward per token (~5x the CPU in fp32); its incremental steps give the same logits to
    the order of their sums (~1e-6). Computed once per model, prompt and tokens: several tests check the same."""
    if len(tokens) != length:
        return f"{len(tokens)} tokens, not {length}"
    choices = _greedy_choices(transformers_model(loaded), loaded.eos_token_ids, prompt_ids, tokens)
    for step, (token, choice) in enumerate(zip(tokens, choices)):
        if token != choice:
            return f"step {step}: token {token} where transformers' greedy choice is {choice}"
    return None


def _greedy_choices(model, eos_token_ids, prompt_ids: list[int], tokens: list[int]) -> list[int]:
    known = _GREEDY_CHOICES.setdefault(model, {})
    key = (tuple(prompt_ids), tuple(tokens))
    if key not in known:
        with torch.inference_mode():
            ids = torch.tensor([prompt_ids + tokens[:-1]], device=model.device)
            logits = model(ids, use_cache=False, logits_to_keep=len(tokens)).logits[0].float()
            logits[:, list(eos_token_ids)] = float("-inf")
            known[key] = logits.argmax(-1).tolist()
    return known[key]


def engine_greedy_with_logprobs(loaded, prompts: list[str], max_tokens: int, **engine_fields) -> tuple[list[Request], dict]:
    """Greedy runs of ``prompts`` in one batch; the requests, and each one's chosen-token log-probabilities."""
    engine = make_engine(loaded, **engine_fields)
    requests = [Request(str(i), loaded.tokenizer.encode(p), greedy(max_tokens, logprobs=1), loaded.eos_token_ids)
                for i, p in enumerate(prompts)]
    engine.add_requests(requests)
    logprobs = {r.request_id: [] for r in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            logprobs[out.request_id] += out.logprobs or []
    return requests, logprobs


def assert_tracks_transformers(loaded, requests: list[Request], logprobs: dict, tolerance: float) -> float:
    """Teacher-forced through transformers' own forward of the same model: every token the engine chose is that
    model's top choice up to a near-tie, with the same log-probability (within ``tolerance``); returns the largest gap."""
    worst, model = 0.0, transformers_model(loaded)
    for request in requests:
        assert len(logprobs[request.request_id]) == request.num_output_tokens
        ids = torch.tensor([request.prompt_token_ids + list(request.output_token_ids)], device=model.device)
        with torch.inference_mode():
            reference = model(ids).logits[0].float().log_softmax(-1)
        for step, lp in enumerate(logprobs[request.request_id]):
            row = reference[len(request.prompt_token_ids) - 1 + step].clone()
            row[list(loaded.eos_token_ids)] = float("-inf")  # greedy() masks EOS, as min_new_tokens does
            gap = abs(lp.logprob - float(row[lp.token_id]))
            worst = max(worst, gap)
            assert gap < tolerance, (request.request_id, step, gap)
            assert float(row[lp.token_id]) > float(row.max()) - tolerance, (request.request_id, step)
    return worst

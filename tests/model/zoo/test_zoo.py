"""The model zoo: twenty-five tiny seeded checkpoints of transformers architectures, each served exactly as transformers
computes it (fp32: every greedy token transformers' top choice up to a 1e-4 near-tie, every logprob within 1e-4)
or refused at load. Prompts of 7-50 tokens in a batch of 4 (longer than the sliding windows), prefilled in
chunks of at most 32 tokens, then one alone (the prefix cache holds its first blocks) and one that shares a
prefix with it; with the CPU kernels on and off."""

from __future__ import annotations


import pytest
import torch

from app.config import EngineConfig, ModelConfig
from app.engine import Request, SamplingParams
from app.engine.engine import LLMEngine
from app.engine.kv_cache import DROPPED
from app.engine.parity import ParityError, check_parity
from app.models import load_model
from tests.model.zoo.checkpoints import ARCHITECTURES, WINDOW, _spread_norms, build_checkpoint

pytestmark = pytest.mark.model

TOLERANCE = 1e-4
NEW_TOKENS = 6
PROMPT_LENGTHS = (7, 20, 41, 50)
# Architectures the engine refuses, with what the refusal names.
REFUSED = {"falcon": "did not take the paged attention path",
           "jetmoe": "passes 4 key heads of size 16 where its config states 2 of 16",
           "qwen2-moe-mixed": f"gives attention layer 0 a {WINDOW}-token sliding window, but the layer attended with the whole history"}
CAPPED = {"phi3-longrope": 32}  # served to this context (app/models/exact_context.py), tested on their own below
SERVED = [name for name in ARCHITECTURES if name not in REFUSED and name not in CAPPED]


def _engine(path, **engine_fields):
    loaded = load_model(ModelConfig(source=str(path), dtype="float32", max_model_len=256))
    fields = {"num_kv_blocks": 64, "max_num_batched_tokens": 32, "max_num_seqs": 16, **engine_fields}
    return loaded, LLMEngine(loaded, EngineConfig(**fields))


def _reference_model(path):
    from transformers import AutoConfig

    from app.models.loader import _model_class

    model_class = _model_class(AutoConfig.from_pretrained(path))  # transformers' own class for it, as the loader picks
    return model_class.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _prompts(tokenizer, vocab: int) -> list[list[int]]:
    text = "In the beginning the engine read every key once, and the cache kept blocks of sixteen tokens each. " * 4
    ids = [t for t in tokenizer.encode(text) if t < vocab]
    return [ids[:n] for n in PROMPT_LENGTHS]


def _run(engine: LLMEngine, prompts: list[list[int]], tag: str) -> list[Request]:
    sampling = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0, logprobs=1)
    requests = [Request(f"{tag}-{i}", prompt, sampling, frozenset()) for i, prompt in enumerate(prompts)]
    engine.add_requests(requests)
    logprobs = {r.request_id: [] for r in requests}
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.error is None, output.error
            logprobs[output.request_id] += output.logprobs or []
    for request in requests:
        request.logprobs = logprobs[request.request_id]
    return requests


def _assert_matches_transformers(reference, requests: list[Request]) -> None:
    for request in requests:
        assert request.num_output_tokens == NEW_TOKENS and len(request.logprobs) == NEW_TOKENS
        ids = torch.tensor([request.prompt_token_ids + request.output_token_ids])
        with torch.inference_mode():
            rows = reference(ids).logits[0].float().log_softmax(-1)  # [L, V]
        for step, lp in enumerate(request.logprobs):
            row = rows[request.num_prompt_tokens - 1 + step]
            assert abs(lp.logprob - float(row[lp.token_id])) <= TOLERANCE, (request.request_id, step)
            assert float(row[lp.token_id]) >= float(row.max()) - TOLERANCE, (request.request_id, step)


@pytest.mark.parametrize("kernels", ["kernels on", "kernels off"])
@pytest.mark.parametrize("name", SERVED)
def test_served_exactly(name, kernels, zoo_dir, tokenizer, request):
    if kernels == "kernels off":
        request.getfixturevalue("kernels_off")
    path = build_checkpoint(name, zoo_dir, tokenizer)
    loaded, engine = _engine(path)
    check_parity(engine, loaded)
    reference = _reference_model(path)
    prompts = _prompts(tokenizer, loaded.model.config.vocab_size)
    batched = _run(engine, prompts, "batch")
    alone = _run(engine, prompts[2:3], "alone")  # its first two blocks come from the prefix cache
    shared = _run(engine, [prompts[2][:35] + prompts[1][:9]], "shared")  # two cached blocks, then its own tokens
    assert engine.blocks.prefix_stats.hit_tokens >= 64
    assert alone[0].output_token_ids == batched[2].output_token_ids
    _assert_matches_transformers(reference, batched + alone + shared)


@pytest.mark.parametrize("name", ["llama", "granite", "gemma3"])  # plain; a scaled attention; windowed + global layers
def test_prompt_chunks_through_sdpa_served_exactly(name, zoo_dir, tokenizer, monkeypatch):
    """The route a CPU that times SDPA faster on prompts takes: prompt chunks (from the first token, and deeper, the
    step budget being 32) through SDPA, everything else (and sliding-window layers) on our kernel; a lowered threshold
    so the test's prompts take it."""
    from app.engine import paged_attention
    from app.engine.attention_choice import AttentionRoute

    calls = []
    through_sdpa = paged_attention._prompt_chunks_through_sdpa
    monkeypatch.setattr(paged_attention, "_prompt_chunks_through_sdpa", lambda *args: calls.append(1) or through_sdpa(*args))
    path = build_checkpoint(name, zoo_dir, tokenizer)
    loaded, engine = _engine(path)
    if engine.runner.attention.kernel is None:
        pytest.skip("the CPU kernels cannot run here: no kernel route to split")
    engine.runner.attention = AttentionRoute(engine.runner.attention.kernel, frozenset({"decode"}), prompt_min=8)
    check_parity(engine, loaded)
    assert calls, "the parity check took SDPA for its prompts"
    calls.clear()
    batched = _run(engine, _prompts(tokenizer, loaded.model.config.vocab_size), "batch")
    assert calls
    _assert_matches_transformers(_reference_model(path), batched)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_at_load_by_name(name, zoo_dir, tokenizer):
    loaded, engine = _engine(build_checkpoint(name, zoo_dir, tokenizer))
    with pytest.raises(ParityError, match=REFUSED[name]) as refusal:
        check_parity(engine, loaded)
    assert loaded.model.config.architectures[0] in str(refusal.value)


@pytest.mark.parametrize("name", ["falcon", "qwen2-moe-mixed"])  # what only the paths and windows taken show
def test_refused_at_start_without_the_parity_check_too(name, zoo_dir, tokenizer):
    """engine.parity_check: false skips the comparison with transformers, not the check that every layer took the paged
    path with its configured window: the warm-up's step is checked, and the replica does not start."""
    from app.config import ServedModelConfig
    from app.server import build_model_core

    model = ModelConfig(source=str(build_checkpoint(name, zoo_dir, tokenizer)), dtype="float32", max_model_len=256)
    engine = EngineConfig(parity_check=False, num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=16,
                          torch_threads=torch.get_num_threads(), cpu_threads_bind="none")  # this process's threads kept
    with pytest.raises(ParityError, match=REFUSED[name]):
        build_model_core(ServedModelConfig(model=model, engine=engine))


def test_sliding_window_blocks_stay_bounded(zoo_dir, tokenizer):
    """Mistral (every layer slides): a long generation holds the blocks of its window (and the step's tokens),
    not of its history; its tokens stay transformers' own."""
    path = build_checkpoint("mistral", zoo_dir, tokenizer)
    loaded, engine = _engine(path, block_size=8)
    assert engine.scheduler.config.sliding_window == WINDOW
    prompt = _prompts(tokenizer, loaded.model.config.vocab_size)[3]
    sampling = SamplingParams(max_tokens=150, min_tokens=150, temperature=0)
    request = Request("long", prompt, sampling, frozenset())
    engine.add_request(request)
    most_live = 0
    while engine.has_unfinished_requests():
        engine.step()
        if engine.has_unfinished_requests():
            most_live = max(most_live, sum(1 for b in engine.blocks.block_table("long") if b != DROPPED))
    bound = -(-(WINDOW + 32) // 8) + 1  # the window and one step's chunk, plus a partial block
    assert 0 < most_live <= bound
    assert request.num_output_tokens == 150
    with torch.inference_mode():
        rows = _reference_model(path)(torch.tensor([prompt + request.output_token_ids])).logits[0]  # [L, V]
    chosen = rows[len(prompt) - 1 : -1].gather(1, torch.tensor(request.output_token_ids).unsqueeze(1)).squeeze(1)
    assert bool((chosen >= rows[len(prompt) - 1 : -1].max(dim=-1).values - TOLERANCE).all())


def test_parity_check_refuses_a_layer_off_the_paged_path(zoo_dir, tokenizer):
    from app.engine.paged_attention import PagedStep

    loaded, engine = _engine(build_checkpoint("llama", zoo_dir, tokenizer))
    loaded.model.model.layers[1].self_attn.paged_step = PagedStep()  # never set: this layer attends the packed row
    with pytest.raises(ParityError, match="attention layers 1 did not take the paged attention path"):
        check_parity(engine, loaded)


def test_parity_check_refuses_a_dropped_softcap(zoo_dir, tokenizer, monkeypatch):
    from app.engine import paged_attention

    loaded, engine = _engine(build_checkpoint("gemma2", zoo_dir, tokenizer))
    options = paged_attention.attention_options
    monkeypatch.setattr(paged_attention, "attention_options",
                        lambda kwargs: paged_attention.AttentionOptions(options(kwargs).window, None))
    with pytest.raises(ParityError, match="Gemma2ForCausalLM cannot be served exactly: at generated token"):
        check_parity(engine, loaded)


def test_longrope_is_served_to_its_original_context_and_no_further(zoo_dir, tokenizer):
    """transformers takes longrope's long factors for a whole forward pass once a position passes the original context;
    a packed engine step cannot reproduce that per request, so the context is capped where the short factors hold."""
    from app.models import ModelLoadError

    path = build_checkpoint("phi3-longrope", zoo_dir, tokenizer)
    loaded = load_model(ModelConfig(source=str(path), dtype="float32"))
    assert loaded.max_model_len == CAPPED["phi3-longrope"]  # of its 512 positions
    with pytest.raises(ModelLoadError, match="max_model_len 64 is past the 32 tokens this model is served exactly to: longrope"):
        load_model(ModelConfig(source=str(path), dtype="float32", max_model_len=64))
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=16))
    check_parity(engine, loaded)
    prompts = [prompt[:24] for prompt in _prompts(tokenizer, loaded.model.config.vocab_size)]  # room for 6 new tokens
    _assert_matches_transformers(_reference_model(path), _run(engine, prompts, "batch"))


def test_yarn_serves_its_scaled_context_and_no_further(zoo_dir, tokenizer):
    """YaRN's frequencies are static in transformers: the context is the original times the factor, as vLLM derives
    (test_served_exactly runs this checkpoint's prompts far past its 16 stated positions)."""
    from app.models import ModelLoadError

    path = build_checkpoint("qwen2-yarn", zoo_dir, tokenizer)
    assert load_model(ModelConfig(source=str(path), dtype="float32")).max_model_len == 256
    with pytest.raises(ModelLoadError, match=r"max_model_len 257 exceeds the model's context of 256 tokens \(YaRN rope "
                                             r"scaling, factor 16 over 16 positions\)"):
        load_model(ModelConfig(source=str(path), dtype="float32", max_model_len=257))


def test_linear_rope_serves_its_stated_context_and_up_to_its_factor_when_asked(zoo_dir, tokenizer):
    """Linear scaling's frequencies are static too, but whether max_position_embeddings counts the factor differs by
    checkpoint: the stated context by default, up to factor times it when asked (test_served_exactly asks for 256)."""
    from app.models import ModelLoadError

    path = build_checkpoint("llama-linear", zoo_dir, tokenizer)
    assert load_model(ModelConfig(source=str(path), dtype="float32")).max_model_len == 16
    with pytest.raises(ModelLoadError, match=r"max_model_len 257 exceeds the model's context of 16 tokens \(linear rope "
                                             r"scaling, factor 16: up to 256 is served exactly"):
        load_model(ModelConfig(source=str(path), dtype="float32", max_model_len=257))


def test_a_checkpoint_missing_weights_is_refused_naming_them(zoo_dir, tokenizer, tmp_path):
    """transformers fills a weight the checkpoint lacks with random numbers and goes on (a quantized lm_head it cannot
    read, an older GPTQ layout read as a plain checkpoint): the loader refuses instead, naming what is missing."""
    import shutil

    from safetensors.torch import load_file, save_file

    from app.models import ModelLoadError

    source = build_checkpoint("llama", zoo_dir, tokenizer)
    path = tmp_path / "llama-without-its-head"
    shutil.copytree(source, path)
    weights = load_file(path / "model.safetensors")
    head = weights.pop("lm_head.weight")
    weights["lm_head.qweight"] = head.to(torch.int32)  # what a quantized head looks like to a plain load
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"no values for lm_head.weight, which transformers would fill with random "
                                             r"numbers; the checkpoint holds quantized tensors \(qweight\)"):
        load_model(ModelConfig(source=str(path), dtype="float32"))


def test_a_multimodal_checkpoint_serves_its_text_decoder_exactly(zoo_dir, tokenizer):
    """Gemma 3 from 4B (Mistral Small 3.1, Qwen2.5-VL alike) loads as a *ForConditionalGeneration whose decoder's fields
    sit under text_config: its context, KV shape, windows and vocabulary come from there; text prompts are served
    exactly as transformers computes them (an image part is a 400: docs/api.md)."""
    from transformers import AutoModelForCausalLM, Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    path = zoo_dir / "gemma3-multimodal"
    if not (path / "config.json").exists():
        text = Gemma3TextConfig(vocab_size=len(tokenizer) + 8, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=384,
                                sliding_window=WINDOW, query_pre_attn_scalar=16)
        vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=28, patch_size=14)
        config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=len(tokenizer) + 1,
                              boi_token_index=len(tokenizer) + 2, eoi_token_index=len(tokenizer) + 3)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _spread_norms(model)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    loaded = load_model(ModelConfig(source=str(path), dtype="float32"))
    assert type(loaded.model).__name__ == "Gemma3ForConditionalGeneration" and loaded.max_model_len == 384
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=16))
    assert engine.runner.kv_pool.shape[0] == 2 and engine.runner.kv_pool.shape[-1] == 16
    check_parity(engine, loaded)
    _assert_matches_transformers(_reference_model(path), _run(engine, _prompts(tokenizer, len(tokenizer)), "batch"))


def _image_text_to_text_config(kind: str, tokenizer):
    """A tiny multimodal config of a model type transformers registers as image-text-to-text alone."""
    import transformers

    vocab, small = len(tokenizer), dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=384)
    text = dict(vocab_size=vocab + 8, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **small)
    if kind == "mistral3":  # Mistral Small 3.1 / 3.2
        return transformers.Mistral3Config(
            text_config=transformers.MistralConfig(**text, head_dim=16, sliding_window=None), image_token_index=vocab + 1,
            vision_config=transformers.PixtralVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                           num_attention_heads=2, image_size=28, patch_size=14, head_dim=16),
            spatial_merge_size=1)
    if kind == "qwen2_5_vl":  # its multimodal RoPE: three sections, one position each for text
        return transformers.Qwen2_5_VLConfig(
            text_config={**text, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                               fullatt_block_indexes=[0]),
            image_token_id=vocab + 1, video_token_id=vocab + 2, vision_start_token_id=vocab + 3)
    return transformers.LlavaConfig(text_config=transformers.LlamaConfig(**text), image_token_index=vocab + 1,
                                    vision_config=transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64,
                                                                                num_hidden_layers=1, num_attention_heads=2,
                                                                                image_size=28, patch_size=14))


@pytest.mark.parametrize("kind", ["mistral3", "qwen2_5_vl", "llava"])
def test_a_model_transformers_has_as_image_text_to_text_alone_serves_its_text_decoder_exactly(kind, zoo_dir, tokenizer):
    """transformers has no causal-LM class for these multimodal types: the loader takes their image-text-to-text model,
    whose text prompts are served exactly as transformers computes them."""
    from transformers import AutoModelForImageTextToText

    path = zoo_dir / f"{kind}-multimodal"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(_image_text_to_text_config(kind, tokenizer), dtype=torch.float32)
        _spread_norms(model)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    loaded = load_model(ModelConfig(source=str(path), dtype="float32", max_model_len=256))
    assert type(loaded.model).__name__.endswith("ForConditionalGeneration")
    engine = LLMEngine(loaded, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=16))
    check_parity(engine, loaded)
    _assert_matches_transformers(_reference_model(path), _run(engine, _prompts(tokenizer, len(tokenizer)), "batch"))


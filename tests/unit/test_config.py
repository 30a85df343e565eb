import pytest

from app.config import AppConfig, ModelConfig, ServedModelConfig


def test_defaults_serve_the_embedded_model():
    config = AppConfig()
    assert config.models[0].model.source == "smollm2-135m-instruct"
    assert config.models[0].model.name == "smollm2-135m-instruct"


def test_dtype_aliases_are_normalised():
    assert ModelConfig(dtype="bf16").dtype == "bfloat16"
    assert ModelConfig(dtype="fp32").dtype == "float32"


@pytest.mark.parametrize(
    "data, message",
    [
        ({"models": [{"model": {"dtype": "int3"}}]}, "model.dtype"),
        ({"models": [{"model": {"device": "tpu"}}]}, "model.device"),
        ({"models": [{"model": {"quantization": "awq"}}]}, "model.quantization 'awq' is not one of none, bnb-int8"),
        ({"models": [{"engine": {"batching": "magic"}}]}, "engine.batching"),
        ({"models": [{"replica": {"num_replicas": 0}}]}, "num_replicas"),
        ({"models": [{"modle": {}}]}, "unknown key"),
        ({"models": []}, "at least one model"),
        ({"models": [{"model": "a"}, {"model": "a"}]}, "unique"),
        ({"models": [{"default_sampling": {"temprature": 0.1}}]}, "default_sampling"),
        ({"models": [{"engine": {"max_num_batched_tokens": 0}}]}, "engine.max_num_batched_tokens"),
        ({"models": [{"engine": {"max_num_batched_tokens": 32}}]}, r"engine.max_num_batched_tokens \(32\) must be at least engine.max_num_seqs \(64\)"),
        ({"models": [{"replica": {"num_replicas": 3, "autoscaling_config": {"max_replicas": 6}}}]}, "an autoscaled deployment has no fixed count"),
        ({"models": [{"replica": {"num_replicas": "auto", "target_queue_depth": 128}}]}, r"target_queue_depth \(128\) must be below what a replica holds"),
        ({"models": [{"replica": {"num_gpus": 0.5}}]}, r"replica.num_gpus 0.5 shares a GPU: set engine.kv_cache_memory_mb"),
        ({"models": [{"engine": {"block_size": "16"}}]}, "engine.block_size"),
        ({"models": [{"engine": {"batch_wait_timeout_s": -1}}]}, "engine.batch_wait_timeout_s"),
        ({"models": [{"engine": {"kv_cache_memory_mb": -5}}]}, "engine.kv_cache_memory_mb"),
        ({"models": [{"engine": {"max_stream_chunks_per_s": -1}}]}, "engine.max_stream_chunks_per_s"),
        # YAML's "false" is a string, which Python would take as true
        ({"models": [{"engine": {"separate_process": "false"}}]}, r"engine.separate_process must be true or false, got 'false'"),
        ({"models": [{"model": {"trust_remote_code": "no"}}]}, "model.trust_remote_code must be true or false"),
        ({"models": [{"replica": {"num_cpus": "two"}}]}, r"app.models\[0\].replica.num_cpus must be a number, got 'two'"),
        ({"models": [{"engine": {"step_timeout_s": True}}]}, "engine.step_timeout_s must be a number"),
        # a bad default would fail every request that leaves the field unset
        ({"models": [{"default_sampling": {"temperature": "hot"}}]}, "default_sampling.temperature must be a number"),
        ({"models": [{"default_sampling": {"top_p": 0}}]}, r"default_sampling.top_p: top_p must be in \(0, 1\]"),
        ({"models": [{"default_sampling": {"top_k": 2.5}}]}, "default_sampling.top_k must be an integer"),
        ({"models": [{"default_sampling": ["temperature", 0.2]}]}, "default_sampling must be a mapping"),
        ({"models": [{"default_sampling": None}]}, "default_sampling must be a mapping"),
        ({"models": [{"replica": {"num_replicas": True}}]}, "replica.num_replicas must be an integer"),  # YAML's true
        # Ray would reserve no GPU and leave CUDA_VISIBLE_DEVICES alone: the replica would take one unseen
        ({"models": [{"model": {"device": "cuda"}, "replica": {"num_gpus": 0}}]}, "model.device: cuda with replica.num_gpus: 0"),
        ({"models": [{"engine": {"speculative": {"drafter": "ngram", "served_name": "a b"}}}]}, "served_name must be a name clients"),
        (
            {"models": [{"engine": {"max_batch_size": 32}, "replica": {"max_ongoing_requests": 8}}]},
            "max_ongoing_requests .* must be at least engine.max_batch_size",
        ),
    ],
)
def test_bad_configs_say_what_is_wrong(data, message):
    with pytest.raises(ValueError, match=message):
        AppConfig.from_dict(data)


@pytest.mark.parametrize("data, message", [
    ({"models": [{"model": "a"}, {"model": "b", "engine": {"max_num_seqs": 0}}]},
     r"^app.models\[1\].engine.max_num_seqs must be an integer >= 1, got 0$"),  # which model: this app serves two
    ({"models": [{"model": "a"}, {"model": "b", "engine": {"speculative": {"drafter": "ngram", "ngram_max": 0}}}]},
     r"^app.models\[1\].engine.speculative.ngram_max \(at least ngram_min\) must be"),
    ({"models": [{"model": "a", "default_sampling": {"temperature": 5}}]},
     r"^app.models\[0\].default_sampling.temperature must be in \[0, 2\], as a request's own value"),
    ({"models": []}, r"^app: the app must serve at least one model"),
])
def test_a_bad_value_is_named_from_the_configs_root(data, message):
    with pytest.raises(ValueError, match=message):
        AppConfig.from_dict(data)


def test_a_yaml_file_with_a_key_given_twice_or_bad_syntax_is_refused_naming_the_line(tmp_path):
    twice = tmp_path / "twice.yaml"  # PyYAML keeps the second engine block whole: max_num_seqs 8 would be lost
    twice.write_text("models:\n  - model: a\n    engine: {max_num_seqs: 8}\n    engine: {block_size: 32}\n")
    with pytest.raises(ValueError, match=r"(?s)key 'engine' is given twice in one mapping.*line 4"):
        AppConfig.from_yaml(twice)
    broken = tmp_path / "broken.yaml"
    broken.write_text("models:\n  - model: {source: a\n")
    with pytest.raises(ValueError, match="is not valid YAML"):
        AppConfig.from_yaml(broken)
    merged = tmp_path / "merged.yaml"  # a merge key's values may be overridden: no key is given twice
    merged.write_text("models:\n  - model: a\n    engine: &engine {max_num_seqs: 8, block_size: 16}\n"
                      "  - model: b\n    engine:\n      <<: *engine\n      block_size: 32\n")
    engines = [served.engine for served in AppConfig.from_yaml(merged).models]
    assert [(e.max_num_seqs, e.block_size) for e in engines] == [(8, 16), (8, 32)]


def test_from_args_merges_file_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("models:\n  - model: {source: smollm2-135m-instruct, dtype: bf16}\nmax_request_bytes: 2048\n")
    config = AppConfig.from_args({"config": str(path), "max_request_bytes": 4096})
    assert config.max_request_bytes == 4096
    assert config.models[0].model.dtype == "bfloat16"


def test_from_args_config_must_name_a_file():
    with pytest.raises(ValueError, match="args.config must name a YAML file, got None"):
        AppConfig.from_args({"config": None})


def test_optional_fields_take_null_and_numbers_take_integers():
    config = AppConfig.from_dict({"models": [{"model": {"max_model_len": None, "revision": None},
                                              "replica": {"num_cpus": 2, "num_gpus": None}}]})
    assert config.models[0].replica.num_cpus == 2 and config.models[0].model.max_model_len is None


def test_model_shorthand_string():
    config = AppConfig.from_dict({"models": [{"model": "org/model"}]})
    assert isinstance(config.models[0], ServedModelConfig)
    assert config.models[0].model.source == "org/model"


def test_repo_presets_parse():
    """Every app config in configs/ (the Kubernetes and cluster manifests there have tests of their own)."""
    import yaml

    from tests.conftest import ROOT

    presets = [p for p in (ROOT / "configs").glob("*.yaml") if "models" in (yaml.safe_load(p.read_text()) or {})]
    assert len(presets) >= 2
    for path in presets:
        AppConfig.from_yaml(path)


def test_mode_none_runs_one_sequence_at_a_time():
    from app.config import EngineConfig

    assert EngineConfig(batching="none", max_num_seqs=64).max_num_seqs == 1
    assert EngineConfig().batching == "continuous"


@pytest.mark.parametrize("kernels, native, expected",
                         [(True, True, "float32"), (True, False, "float32"), (False, True, "bfloat16"), (False, False, "float32")])
def test_auto_dtype_on_cpu_is_fp32_on_our_kernels_else_bf16_only_where_native(monkeypatch, kernels, native, expected):
    # Our fp32 kernels beat torch's native bf16 (one stream 2.3x on an AVX-512 EPYC); emulated bf16 (AVX2-only
    # CPUs) made batched steps ~6x slower than fp32.
    import torch

    from app.cpu import ops
    from app.models import loader

    monkeypatch.setattr(ops, "available", lambda: kernels)
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: native)
    assert loader.resolve_dtype("auto", torch.device("cpu")) == getattr(torch, expected)
    assert loader.resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


@pytest.mark.parametrize("flags, onednn, native", [
    (frozenset({"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq"}), True, False),  # Skylake: oneDNN converts only
    (frozenset({"avx512f", "avx512_bf16"}), True, True), (frozenset({"amx_tile", "amx_bf16"}), True, True),
    (frozenset({"avx512_bf16"}), False, False),  # a torch build without oneDNN's bf16
    (None, True, True),  # no /proc/cpuinfo flags (another OS, ARM's "Features"): oneDNN's own test decides
])
def test_native_bf16_needs_the_cpus_bf16_instructions_not_only_onednns_conversions(monkeypatch, flags, onednn, native):
    import torch

    from app.models import loader

    monkeypatch.setattr(loader.host_cpus, "cpu_flags", lambda: flags)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn)
    assert loader.cpu_has_native_bf16() is native


def test_a_speculative_twin_name_needs_a_drafter_and_must_be_unique():
    from app.config import AppConfig

    twin = {"speculative": {"drafter": "ngram", "served_name": "m-ngram"}}
    config = AppConfig.from_dict({"models": [{"model": {"source": "m"}, "engine": twin}]})
    assert config.models[0].served_names == ["m", "m-ngram"]
    with pytest.raises(ValueError, match="served_name needs a drafter"):
        AppConfig.from_dict({"models": [{"model": {"source": "m"}, "engine": {"speculative": {"served_name": "x"}}}]})
    with pytest.raises(ValueError, match="unique; repeated: m-ngram"):
        AppConfig.from_dict({"models": [{"model": {"source": "m"}, "engine": twin}, {"model": {"source": "m-ngram"}}]})


def test_model_names_that_would_share_a_deployment_are_refused_at_build():
    from deployments.builder import build_app

    models = [{"model": "first"}, {"model": {"source": "org/m"}}, {"model": {"source": "x", "name": "org:m"}}]
    with pytest.raises(ValueError, match="models org/m, org:m would all be deployment LLMServer:org-m"):
        build_app({"models": models})


def test_a_relative_path_that_exists_is_named_by_its_last_part(tmp_path, monkeypatch):
    from app.config import ModelConfig

    (tmp_path / "ck" / "llama").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert ModelConfig(source="ck/llama/").name == ModelConfig(source="ck/llama").name == "llama"
    assert ModelConfig(source="org/model").name == "org/model"  # a hub id (nothing of that name here) names itself


@pytest.mark.parametrize("stored, native_bf16, expected", [
    ("float16", True, "float16"), ("bfloat16", True, "bfloat16"), ("float32", True, "bfloat16"), (None, True, "bfloat16"),
    ("bfloat16", False, "float16"), ("float16", False, "float16"),
])
def test_auto_on_a_gpu_keeps_a_float16_checkpoint_in_float16(stored, native_bf16, expected, monkeypatch):
    """As vLLM's auto: a checkpoint trained and stored in float16 stays float16 (bf16 keeps 3 fewer mantissa bits);
    anything else takes bf16 where the GPU has it natively (no GPU needed: the device is only named)."""
    import torch
    from transformers import LlamaConfig

    from app.models import loader

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native_bf16)
    checkpoint = LlamaConfig(dtype=stored) if stored else LlamaConfig()
    assert loader.resolve_dtype("auto", torch.device("cuda"), loader._stored_dtype(checkpoint)) == getattr(torch, expected)
    assert loader.resolve_dtype("float32", torch.device("cuda"), loader._stored_dtype(checkpoint)) == torch.float32


def test_architectures_that_overflow_float16_are_refused_in_it_and_never_given_it_by_auto(monkeypatch):
    """A float16 GPTQ Gemma 2 under auto: bf16 (float32 without native bf16), as vLLM's auto leaves float16 out for it;
    asked for explicitly, float16 is refused naming what to use."""
    import torch
    from transformers import Gemma2Config, Gemma3Config, LlamaConfig

    from app.models import ModelLoadError, loader

    cuda = torch.device("cuda")
    for native_bf16, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: native_bf16)
        assert loader.resolve_dtype("auto", cuda, torch.float16, "gemma2") == expected
    multimodal = Gemma3Config(dtype="float16")  # stated at the top only
    assert loader._stored_dtype(multimodal) == torch.float16

    with pytest.raises(ModelLoadError, match="gemma2 is numerically unstable in float16.*set model.dtype: float32"):
        loader._refuse_unstable_float16(Gemma2Config(), torch.float16, "google/gemma-2-2b-it")
    loader._refuse_unstable_float16(Gemma2Config(), torch.bfloat16, "google/gemma-2-2b-it")
    loader._refuse_unstable_float16(LlamaConfig(), torch.float16, "llama")
    loader._refuse_unstable_float16(None, torch.float16, "unreadable")  # the load itself reports such a checkpoint


def test_the_ingress_takes_what_every_model_it_relays_to_takes_at_its_largest():
    """However few ingress replicas run, they never hold back a model deployment that has scaled out."""
    from deployments.builder import ingress_options

    models = [{"model": "a", "replica": {"max_ongoing_requests": 200, "num_replicas": "auto", "autoscaling_config": {"max_replicas": 6}}},
              {"model": "b", "replica": {"max_ongoing_requests": 100, "num_replicas": 3}},
              {"model": "c", "replica": {"max_ongoing_requests": 150, "num_replicas": "auto"}}]  # Serve's default max: 4
    router = AppConfig.from_dict({"ingress_hosts_first_model": False, "models": models})
    assert ingress_options(router, None)["max_ongoing_requests"] == 200 * 6 + 100 * 3 + 150 * 4
    hosting = AppConfig.from_dict({"models": models})
    assert ingress_options(hosting, hosting.models[0])["max_ongoing_requests"] == 200 + 100 * 3 + 150 * 4

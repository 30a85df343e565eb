"""Model resolution and loading (HF id, local directory, GGUF file, built-in models)."""

from app.models.loader import LoadedModel, ModelLoadError, load_model, resolve_device, resolve_dtype

__all__ = ["LoadedModel", "ModelLoadError", "load_model", "resolve_device", "resolve_dtype"]

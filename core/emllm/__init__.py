"""EM-LLM episodic memory for Hugging Face causal LMs (the engine; no framework dependencies)."""

from .config import PRESETS, ConfigError, EMConfig
from .engine import EMEngine, GenerationResult, Inspection, MemoryMismatchError, TextStream
from .memory import EpisodicMemory
from .models import (DEFAULT_MODEL, EMBEDDED_MODELS, ModelNotAvailableError, UnsupportedModelError, load_model,
                     model_fingerprint)
from .storage import StorageFullError

__all__ = ["PRESETS", "ConfigError", "EMConfig", "EMEngine", "GenerationResult", "Inspection", "MemoryMismatchError",
           "TextStream", "EpisodicMemory", "DEFAULT_MODEL", "EMBEDDED_MODELS", "ModelNotAvailableError",
           "UnsupportedModelError", "load_model", "model_fingerprint", "StorageFullError"]

"""EM-LLM episodic memory for Hugging Face causal LMs (the engine; no framework dependencies)."""

from . import scoring
from .config import DEFAULT_PRESET, PRESETS, ConfigError, EMConfig
from .engine import EMEngine, GenerationResult, Inspection, MemoryMismatchError, TextStream
from .grammar import Grammar, GrammarError
from .memory import EpisodicMemory, RetrievedEvent
from .models import (DEFAULT_MODEL, EMBEDDED_MODELS, ModelNotAvailableError, UnsupportedModelError, load_model,
                     model_fingerprint)
from .persistence import MemoryFileError, load_memory, save_memory
from .scoring import AttentionMass, ForQuestions, Pooled, Representatives, RetrievalPlan, Scorer
from .sessions import MemoryPool, shared_engine
from .storage import StorageFullError

__all__ = ["DEFAULT_PRESET", "PRESETS", "ConfigError", "EMConfig", "EMEngine", "GenerationResult", "Inspection",
           "MemoryMismatchError", "TextStream", "Grammar", "GrammarError", "EpisodicMemory", "RetrievedEvent",
           "MemoryPool", "shared_engine", "MemoryFileError", "load_memory", "save_memory", "DEFAULT_MODEL",
           "EMBEDDED_MODELS", "ModelNotAvailableError", "UnsupportedModelError", "load_model", "model_fingerprint",
           "StorageFullError", "scoring", "Scorer", "Representatives", "AttentionMass", "ForQuestions", "Pooled",
           "RetrievalPlan"]

"""SpecEE: an inference engine for Llama-style decoders (Llama, Mistral, Qwen2/3, Gemma 3, Phi-3) with speculative
early exiting."""
from specee_core.model.config import ModelConfig
from specee_core.decode.engine import SpecEEEngine
from specee_core.options import EngineOptions
from specee_core.step.sampling import SamplingParams
from specee_core.step.state import GenerationResult, PromptError
from specee_core.model.loader import load_model, load_tokenizer

__all__ = ["EngineOptions", "GenerationResult", "ModelConfig", "PromptError", "SamplingParams", "SpecEEEngine", "load_model",
           "load_tokenizer"]

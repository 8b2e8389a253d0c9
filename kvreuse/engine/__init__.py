"""The engine: ``LLMEngine`` (engine.py: the step loop and the request lifecycle), built from an
``EngineConfig`` by builder.py (``build_engine_parts``), with the caller-side request groups
(groups.py) and what it reports about itself (stats.py)."""

from kvreuse.engine.engine import LLMEngine
from kvreuse.engine.stats import EngineStats, StepTiming

__all__ = ["EngineStats", "LLMEngine", "StepTiming"]

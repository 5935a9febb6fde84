"""Factory: a declarative research factory for asynchronous agentic RL on language models."""

__version__ = "0.1.0"

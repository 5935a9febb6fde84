"""Environments: agent programs that talk to the gateway's OpenAI endpoint. See base.py."""

from factory.envs.base import ENVIRONMENTS, Environment, EpisodeResult, register_environment

__all__ = ["ENVIRONMENTS", "Environment", "EpisodeResult", "register_environment"]

from factory.envs import single_turn, tool_agent  # noqa: E402,F401  (they register themselves)

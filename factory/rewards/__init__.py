"""Scorers: turn an episode's final answer into a reward."""

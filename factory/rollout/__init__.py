"""Rollout: the engines that generate (vLLM, SGLang, HF), their servers, the gateway and episodes."""

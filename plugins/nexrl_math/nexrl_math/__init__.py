"""Verified math rewards for NexRL agents (see `nexrl_math.reward`)."""

from nexrl_math.reward import Answer, answers_match, extract_answer, math_reward, parse_reference

__all__ = ["Answer", "answers_match", "extract_answer", "math_reward", "parse_reference"]

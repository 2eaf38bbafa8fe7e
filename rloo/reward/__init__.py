"""Rewards and judges: the verifier, the reward model's rewards, preference pairs, the LLM judge."""

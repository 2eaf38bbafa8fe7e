"""Prompt data: the embedded GSM8K-format generator and the real loaders (hub, JSONL)."""

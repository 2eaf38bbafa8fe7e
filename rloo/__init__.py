"""rloo: a reproducible post-training pipeline (prepare → SFT → reward model → RLOO → evaluation)."""

__version__ = "0.1.0"

"""Ready-made pipeline layers for models users already have (``litgpt``: Lightning AI's LLMs)."""

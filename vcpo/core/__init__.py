"""The math of every method, as pure PyTorch functions (no framework import)."""

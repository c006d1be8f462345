"""Losses, the online training loop, the weight store, offline validation."""

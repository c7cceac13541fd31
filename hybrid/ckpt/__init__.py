"""Checkpoints: saving and resuming across layouts, confined reading, export (torch)."""

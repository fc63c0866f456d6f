"""Test support: generated images and data folders (no downloads, seeded)."""

"""imgret: the shared core (settings, image decoding, the Embedder, metrics, CLI)."""

__version__ = "0.1.0"

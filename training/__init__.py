"""Offline training of image embeddings with metric-learning losses (the Reality-Check protocol)."""

"""The gallery in SQL (source of truth), ingest jobs, and the FAISS index derived from it."""

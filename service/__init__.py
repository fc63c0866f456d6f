"""The FastAPI service: search, gallery management, evaluation, web page."""

"""CLI commands, one module per area; each exposes ``register(app, *, db_app, index_app)``."""

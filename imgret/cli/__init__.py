"""The `imgret` command line: thin Typer wrappers on top of every layer.

Each command parses its options and calls one function of its own layer
(``imgret.training.loop.train``, ``imgret.cli.jobs.gallery.*``, ``imgret.service.run.serve``);
nothing below imports
``cli``. Heavy libraries are imported inside the commands, so ``imgret --help`` starts at once.

- ``main``: the Typer app, its command groups, and one-line errors (the console script);
- ``__main__``: ``python -m imgret.cli`` (and ``torchrun -m imgret.cli train ...``);
- ``train``: ``train``, ``benchmark`` and ``tune``, their options read from ``TrainConfig``;
- ``data``: ``data glyphs``, the generated glyph set written as an ImageFolder;
- ``gallery``: ``db upgrade|downgrade``, ``ingest``, ``index build``, ``media migrate``;
- ``models``: ``models list|register|embed|compare|activate|rollback|delete``;
- ``serve``: ``serve``, the API under uvicorn;
- ``evaluate``: ``evaluate``, a stored query set through the index (as ``POST /evaluate``);
- ``demo``: ``demo``, the whole pipeline on Fashion-MNIST, then the server;
- ``backup``: ``backup`` and ``restore``.
"""

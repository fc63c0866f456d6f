"""The `imgret` command line: thin Typer wrappers on top of every layer.

Each command parses its options and calls one function of its own layer
(``training.loop.train``, ``index.commands.*``, ``service.run.serve``); nothing below imports
``cli``. Heavy libraries are imported inside the commands, so ``imgret --help`` starts at once.
"""

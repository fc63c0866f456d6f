"""``python -m cli`` (and ``torchrun -m cli train ...``): the `imgret` command."""

from cli.main import main

main()

"""``python -m imgret.cli`` (and ``torchrun -m imgret.cli train ...``): the `imgret` command."""

from imgret.cli.main import main

main()

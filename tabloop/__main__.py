"""``python -m tabloop``: the same as the ``tabloop`` command."""

from tabloop.cli import main

main()

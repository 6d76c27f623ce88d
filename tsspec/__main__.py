"""``python -m tsspec``: the same command line as the ``tsspec`` script."""

from tsspec.cli import main

main()

"""``python -m ssdsl``: the same command line as the ``ssdsl`` script (and the torchrun target)."""

from ssdsl.cli import run_main

run_main()

"""`python -m trellis_cli` runs the same entry point as the `trellis` console script."""

from trellis_cli.cli.app import main

main()

"""The ``multislice`` command (console script ``multislice = "multislice.cli:main"``, or ``python -m multislice.cli``).

:func:`main` parses the arguments (:func:`build_parser`) and runs the sub-command's handler, turning an expected
error into ``error:``/``fix:`` lines and an exit status.
"""

from multislice.cli.app import build_parser, main

__all__ = ["build_parser", "main"]

"""``python -m kvbench.bench``: what compression costs (see :mod:`kvbench.bench.cli`)."""

from .cli import main, parse_args, run
from .common import Row

__all__ = ["main", "parse_args", "run", "Row"]

"""The launcher's names under this import path; the launcher itself is `voxtriton.launch`."""

from ..launch.serve import parse_params
from ..launch.server import TritonServer, free_port

__all__ = ["TritonServer", "free_port", "parse_params"]

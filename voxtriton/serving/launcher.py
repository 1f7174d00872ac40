"""The launcher's names under this import path; the launcher itself is `voxtriton.launch`."""

from ..launch.serve import parse_params
from ..launch.server import TritonServer, free_port, free_ports

__all__ = ["TritonServer", "free_port", "free_ports", "parse_params"]

"""`voxtriton serve` and `TritonServer`: tritonserver over the voxtriton model repository.

tritonserver.py finds the server and its Python backend; repository.py renders the model repository;
gpus.py picks the GPUs and runs CUDA MPS; server.py supervises the process; preflight.py checks a
serve command before anything starts; serve.py is the command.
"""

from .server import TritonServer

__all__ = ["TritonServer"]

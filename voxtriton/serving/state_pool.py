"""The codec streaming state of every stream, in memory that both codec lanes reach in place.

A stream's codec state (~5 MB for the 12 Hz codec: its transformer's key/value window and every
causal convolution's history) used to travel through BLS with each chunk, both ways. That copy,
not the decode, dominated a codec call. Now the `tts` model owns one pool with a row per stream
slot; a BLS call carries only the slot numbers and a small handle to the pool, and the codec
instance that decodes the chunk reads and writes the rows in place. Any chunk can still go to
either lane, and a restarted lane re-attaches from the handle its next call brings.

On a GPU the pool is device memory shared through CUDA IPC; on CPU it is a file in shared memory.
A stream has one chunk in flight at a time, so no row is ever touched by two lanes at once, and a
codec call synchronises before it answers, so the next call (in any process) sees its writes.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from pathlib import Path

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

# Only files we made can be attached: a handle comes in as a model input, so a client could send one.
_FILE_PREFIX = "voxtriton-codec-state-"
_FILE_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())

_attached: dict[bytes, torch.Tensor] = {}
_attach_lock = threading.Lock()


class CodecStatePool:
    """rows x state_size fp32, zeros; owned by the process that creates it (the `tts` model)."""

    def __init__(self, rows: int, state_size: int, device: torch.device | str):
        device = torch.device(device)
        self.rows, self.state_size = rows, state_size
        self._path: Path | None = None
        if device.type == "cuda":
            self.tensor = torch.zeros(rows, state_size, device=device)
            # What torch.multiprocessing sends for a CUDA tensor, as plain data (never pickle: a
            # handle arrives as a model input).
            (index, memory, size_bytes, offset_bytes, counter, counter_offset, event,
             event_sync) = self.tensor._typed_storage()._share_cuda_()
            description = {"kind": "cuda", "device": index, "memory": memory.hex(), "size_bytes": size_bytes,
                           "offset_bytes": offset_bytes, "counter": counter.hex(), "counter_offset": counter_offset,
                           "event": event.hex() if event else None, "event_sync": bool(event_sync)}
        else:
            descriptor, name = tempfile.mkstemp(prefix=_FILE_PREFIX, dir=_FILE_DIR)
            os.close(descriptor)
            self._path = Path(name)
            self.tensor = _map_file(name, rows, state_size)
            description = {"kind": "file", "path": name}
        self.handle = json.dumps({"rows": rows, "state_size": state_size, **description}).encode()

    def handle_tensor(self) -> torch.Tensor:
        """The handle as a uint8 tensor, to send as a BLS input."""
        return torch.frombuffer(bytearray(self.handle), dtype=torch.uint8)

    def close(self) -> None:
        if self._path is not None:
            self._path.unlink(missing_ok=True)
            self._path = None


def _map_file(path: str, rows: int, state_size: int) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=rows * state_size, dtype=torch.float32).view(rows, state_size)


def attach(handle: bytes) -> torch.Tensor:
    """The pool a handle names, opened once per process."""
    with _attach_lock:
        tensor = _attached.get(handle)
        if tensor is None:
            tensor = _open(handle)
            _attached[handle] = tensor
        return tensor


def _open(handle: bytes) -> torch.Tensor:
    try:
        description = json.loads(handle)
        rows, state_size, kind = int(description["rows"]), int(description["state_size"]), description["kind"]
        if kind == "cuda":
            bytes_or_none = lambda text: bytes.fromhex(text) if text else None
            return rebuild_cuda_tensor(
                torch.Tensor, torch.Size((rows, state_size)), (state_size, 1), 0, torch.storage.TypedStorage,
                torch.float32, int(description["device"]), bytes.fromhex(description["memory"]),
                int(description["size_bytes"]), int(description["offset_bytes"]), False,
                bytes.fromhex(description["counter"]), int(description["counter_offset"]),
                bytes_or_none(description["event"]), bool(description["event_sync"]))
        path = Path(description["path"])
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"state_pool: not a codec state pool handle ({error})") from None
    if (kind != "file" or path.parent != _FILE_DIR or not path.name.startswith(_FILE_PREFIX)
            or path.is_symlink() or not path.is_file()):
        raise ValueError(f"state_pool: {path} is not a codec state file of this server")
    if path.stat().st_size != rows * state_size * 4:
        raise ValueError(f"state_pool: {path} does not hold {rows} x {state_size} states")
    return _map_file(str(path), rows, state_size)

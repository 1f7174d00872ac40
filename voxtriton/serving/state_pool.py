"""The codec streaming state of every stream, in memory that both codec lanes reach in place.

A stream's codec state (~5 MB for the 12 Hz codec: its transformer's key/value window and every
causal convolution's history) is too large to copy through BLS with each chunk. So the `tts` model
owns one pool with a row per stream slot; a BLS call carries only the slot numbers and the pool's
handle, and the codec instance that decodes the chunk reads and writes the rows in place. Any chunk
can go to either lane, and a restarted lane re-attaches from the handle its next call brings.

On a GPU the pool is device memory shared through CUDA IPC; on CPU it is a file in shared memory.
A stream has one chunk in flight at a time, so no row is ever touched by two lanes at once, and a
codec call synchronises before it answers, so the next call (in any process) sees its writes.

`PrimedStates` keeps copies of rows primed with registered voices' reference codes, so that a
voice's next streams start from a copy instead of another codec call.

The handle arrives as a model input, and clients can call the codec models too: a codec process
only attaches the handle that the `tts` model of its own server published in a private file
(keyed by the tritonserver process id), so a forged handle is refused before anything is opened.
The pool's files outlive a process killed before it could remove them only until the next pool is
made (`pool_files`).
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from pathlib import Path

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from .pool_files import new_pool_file, publish_held, published_path, remove_orphans

_attached: tuple[bytes, torch.Tensor] | None = None  # (handle, pool): the latest genuine one
_attach_lock = threading.Lock()


class CodecStatePool:
    """rows x state_size fp32, zeros, owned by the process that creates it (the `tts` model).

    publish_for: the tritonserver pid whose codec processes may attach it (None: in-process use only).
    """

    def __init__(
        self, rows: int, state_size: int, device: torch.device | str, publish_for: int | None = None
    ):
        device = torch.device(device)
        self.rows, self.state_size = rows, state_size
        remove_orphans()  # of servers killed before their pools were closed
        self._path: Path | None = None
        self._published: Path | None = None
        self._holds: list[int] = []  # descriptors holding this pool's files while the process lives
        try:
            if device.type == "cuda":
                self.tensor = torch.zeros(rows, state_size, device=device)
                # What torch.multiprocessing sends for a CUDA tensor, as plain data.
                (index, memory, size_bytes, offset_bytes, counter, counter_offset, event, event_sync) = (
                    self.tensor._typed_storage()._share_cuda_()
                )
                description = {
                    "kind": "cuda",
                    "device": index,
                    "memory": memory.hex(),
                    "size_bytes": size_bytes,
                    "offset_bytes": offset_bytes,
                    "counter": counter.hex(),
                    "counter_offset": counter_offset,
                    "event": event.hex() if event else None,
                    "event_sync": bool(event_sync),
                }
            else:
                self._path, hold = new_pool_file()
                self._holds.append(hold)
                self.tensor = _map_file(str(self._path), rows, state_size)
                description = {"kind": "file", "path": str(self._path)}
            self.handle = json.dumps({"rows": rows, "state_size": state_size, **description}).encode()
            if publish_for is not None:
                self._published = published_path(publish_for)
                self._published.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                self._holds.append(publish_held(self._published, self.handle))
        except BaseException:  # nothing of a pool that could not be made stays held
            self.close()
            raise

    def handle_tensor(self) -> torch.Tensor:
        """The handle as a uint8 tensor, to send as a BLS input."""
        return torch.frombuffer(bytearray(self.handle), dtype=torch.uint8)

    def close(self) -> None:
        """Remove this pool's files (its handle only while it is the one published: a reloaded model
        publishes its new pool's in its place) and let go of them."""
        if self._published is not None and _read(self._published) == self.handle:
            self._published.unlink(missing_ok=True)
        if self._path is not None:
            self._path.unlink(missing_ok=True)
        for hold in self._holds:
            os.close(hold)
        self._published = self._path = None
        self._holds = []


class PrimedStates:
    """Codec states primed with registered voices' reference codes: copies of pool rows on the pool's
    device, under a key naming the codes and the lane that decoded them (equal codes on one lane
    prime equal states), at most `capacity` (about 5 MB each), the least recently used dropped first.

    Pool rows are read and written by the codec processes between calls, so both methods wait for
    their copy before returning: the next codec call on that row sees it, and may overwrite it.
    """

    def __init__(self, pool: torch.Tensor, capacity: int):
        if capacity < 0:
            raise ValueError(f"primed states: capacity must be 0 or more, got {capacity}")
        self.pool, self.capacity = pool, capacity
        self.states: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self.lock = threading.Lock()

    def restore(self, key: tuple, slot: int) -> bool:
        """Copy the state kept under `key` into row `slot`; False if none is kept."""
        with self.lock:
            state = self.states.get(key)
            if state is None:
                return False
            self.states.move_to_end(key)
        self.pool[slot].copy_(state)
        self._wait()
        return True

    def keep(self, key: tuple, slot: int) -> None:
        """Keep a copy of row `slot`, just primed with the codes `key` names."""
        if self.capacity == 0:
            return
        state = self.pool[slot].clone()
        self._wait()
        with self.lock:
            self.states[key] = state
            self.states.move_to_end(key)
            while len(self.states) > self.capacity:
                self.states.popitem(last=False)

    def _wait(self) -> None:
        if self.pool.device.type == "cuda":
            torch.cuda.current_stream(self.pool.device).synchronize()


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _map_file(path: str, rows: int, state_size: int) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=rows * state_size, dtype=torch.float32).view(
        rows, state_size
    )


def attach(handle: bytes, server_pid: int) -> torch.Tensor:
    """The pool a handle names, if it is the one this server's `tts` model published; opened once."""
    try:
        genuine = published_path(server_pid).read_bytes()
    except OSError:
        raise ValueError("state_pool: this server's tts model has published no codec state pool") from None
    if handle != genuine:
        raise ValueError("state_pool: the handle is not this server's codec state pool")
    global _attached
    with _attach_lock:
        if _attached is None or _attached[0] != handle:  # first call, or the tts model was reloaded
            _attached = (handle, _open(handle))
        return _attached[1]


def _open(handle: bytes) -> torch.Tensor:
    description = json.loads(handle)
    rows, state_size = description["rows"], description["state_size"]
    if description["kind"] == "file":
        return _map_file(description["path"], rows, state_size)

    def bytes_or_none(text):
        return bytes.fromhex(text) if text else None

    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size((rows, state_size)),
        (state_size, 1),
        0,
        torch.storage.TypedStorage,
        torch.float32,
        description["device"],
        bytes.fromhex(description["memory"]),
        description["size_bytes"],
        description["offset_bytes"],
        False,
        bytes.fromhex(description["counter"]),
        description["counter_offset"],
        bytes_or_none(description["event"]),
        description["event_sync"],
    )

"""Counting the PyTorch calls a piece of host code makes (each one can cost a GIL hand-off)."""

from __future__ import annotations

from torch.overrides import TorchFunctionMode

from voxtriton.engine.model_runner import ModelRunner


class CallCounter(TorchFunctionMode):
    """PyTorch calls made inside the block; with `as_replays`, each call of those runner methods
    counts as one, whatever it calls (as a graph replay does)."""

    def __init__(self, runner: ModelRunner, as_replays: tuple[str, ...] = ()):
        super().__init__()
        # Those the runner has: an older tree, timed with this script for an A/B, may lack some.
        self.as_replays = tuple(name for name in as_replays if hasattr(runner, name))
        self.runner, self.calls, self.inside = runner, 0, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += self.inside == 0
        return func(*args, **(kwargs or {}))

    def _replayed(self, method):
        def call(*args, **kwargs):
            self.calls += self.inside == 0
            self.inside += 1
            try:
                return method(*args, **kwargs)
            finally:
                self.inside -= 1

        return call

    def __enter__(self):
        for name in self.as_replays:
            setattr(self.runner, name, self._replayed(getattr(self.runner, name)))
        return super().__enter__()

    def __exit__(self, *exc):
        for name in self.as_replays:
            delattr(self.runner, name)  # the class's method again
        return super().__exit__(*exc)


GRAPHED = ("_prefill_padded", "_write_admitted", "_move_row_by_index")

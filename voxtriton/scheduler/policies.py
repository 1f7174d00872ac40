"""Scheduling policies: what each one decodes where, as properties the server reads, registered by name.

`voxserve` is the design's three lanes; `concurrent`, `serial` and `disaggregated` are the baselines
it is compared against on the same code. Plain Python, no tensors.
"""

from __future__ import annotations

URGENT, BACKGROUND, INLINE = "urgent", "background", "inline"


class Policy:
    name: str = ""
    lanes: tuple[str, ...] = (URGENT,)  # the codec lanes its chunks are decoded on
    deadline_order: bool = False  # lanes take the earliest deadline first, else first come first served
    inline_decode: bool = False  # the engine thread decodes between frame steps: no lane workers
    engine_overlap: bool = True  # a frame step may be launched before the previous one's frames are handled
    background_partition: bool = False  # the background lane runs on an SM partition beside the backbone
    codec_on_second_gpu: bool = False  # the codec models take a GPU of their own when there are two

    @property
    def routes_by_slack(self) -> bool:
        """Chunks with slack go to the background lane, the others to the urgent lane."""
        return BACKGROUND in self.lanes


POLICIES: dict[str, Policy] = {}


def register(cls: type[Policy]) -> type[Policy]:
    POLICIES[cls.name] = cls()
    return cls


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {name!r}") from None


@register
class VoxServe(Policy):
    """The three lanes: first chunks and chunks near their deadline on the urgent lane (the whole
    GPU), the others batched on a background lane beside the backbone."""

    name = "voxserve"
    lanes = (URGENT, BACKGROUND)
    deadline_order = True
    background_partition = True


@register
class Concurrent(Policy):
    """One codec lane beside the backbone, no partition, first come first served."""

    name = "concurrent"


@register
class Serial(Policy):
    """The backbone and the codec take turns on the whole GPU: no frame step runs while it decodes."""

    name = "serial"
    lanes = (INLINE,)
    inline_decode = True
    engine_overlap = False


@register
class Disaggregated(Policy):
    """`concurrent` with the codec models on a second GPU."""

    name = "disaggregated"
    codec_on_second_gpu = True


POLICY_NAMES = tuple(POLICIES)

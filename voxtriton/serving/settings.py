"""Settings of the Triton models, read from the `parameters` of their config.pbtxt.

Every knob has a default here and is documented in docs/configuration.md; config.pbtxt only lists
what a deployment changes. Unknown parameter names are rejected so a typo cannot silently do nothing.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..scheduler.policy import BACKGROUND, URGENT, SchedulerConfig

# Parameters the Python backend itself reads.
TRITON_PARAMETERS = {"FORCE_CPU_ONLY_INPUT_TENSORS", "EXECUTION_ENV_PATH"}


def _parameters(model_config: dict | str) -> dict[str, str]:
    if isinstance(model_config, str):
        model_config = json.loads(model_config)
    return {
        key: value["string_value"]
        for key, value in model_config.get("parameters", {}).items()
        if key not in TRITON_PARAMETERS
    }


# `fp8_weights`: no layers, the talker's, or the talker's and the code predictor's (`models.fp8`).
FP8_SCOPES = ("off", "talker", "all")
# `fp8_kv_cache`: no FP8 KV cache, the talker's, or the talker's and the code predictor's (`models.layers`).
FP8_KV_CACHE = ("off", "talker", "on")
TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes"), ("false", "0", "no")  # a boolean parameter's values


def _coerce(kind, text: str, name: str):
    try:
        if kind is bool:
            if text.lower() not in TRUE_WORDS + FALSE_WORDS:
                raise ValueError(text)
            return text.lower() in TRUE_WORDS
        return kind(text)
    except ValueError:
        raise ValueError(
            f"config.pbtxt parameter {name!r}: cannot read {text!r} as {kind.__name__}"
        ) from None


def _check_known(params: dict[str, str], known: set[str]) -> None:
    unknown = sorted(set(params) - known)
    if unknown:
        named = []
        for name in unknown:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)
            named.append(f"{name} (did you mean {close[0]}?)" if close else name)
        raise ValueError(
            f"config.pbtxt: unknown parameter(s) {', '.join(named)}; the keys: docs/configuration.md"
        )


def _from_parameters(cls, params: dict[str, str], prefix: str = ""):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for name, text in params.items():
        if not name.startswith(prefix):
            continue
        key = name[len(prefix) :]
        if key not in fields:
            continue
        kind = {"int": int, "float": float, "bool": bool, "str": str}.get(str(fields[key].type), str)
        values[key] = _coerce(kind, text, name)
    return cls(**values)


@dataclass(frozen=True)
class TTSSettings:
    checkpoint_dir: str = ""  # empty: the embedded tiny random checkpoint (noise), made on first use
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16
    max_streams: int = 64  # running requests (KV-cache rows)
    max_queued: int = 64  # admitted but waiting for a row; beyond this: "server busy"
    # Codec state rows (about 5 MB each) for streams that finished generating and still owe audio: they
    # hold no KV-cache row and do not count against max_streams + max_queued; a full pool refuses.
    max_draining: int = 128
    max_positions: int = 2048  # KV-cache positions per request: prompt + frames
    max_frames: int = 1500  # per request (120 s of audio)
    max_text_bytes: int = 8192
    max_text_tokens: int = 1024
    text_layout: str = "full"  # full (official default) | interleaved
    # Input streaming (a Triton sequence of text pieces): text ids waiting ahead of a stream before it
    # starts, or resumes after running out of text. The codes do not depend on it (a paused stream
    # generates nothing); more: fewer, longer bursts of frames, each later; 1: a frame per id as it comes.
    text_lookahead: int = 1
    # An input stream that gets no text piece for this long ends with an error and frees its row.
    text_idle_timeout_s: float = 10.0
    # And one still open this long after its first piece, whatever comes: no stream holds a row for hours.
    text_stream_max_s: float = 600.0
    default_speaker: str = ""  # CustomVoice speaker when a request names none ("" = first in config)
    # Base checkpoints: registered voices ("" = <cache>/voices), how many, and the largest reference
    # recording a request may bring (bytes of its file).
    voices_dir: str = ""
    max_voices: int = 1000
    max_reference_bytes: int = 16 << 20
    # In-context voices (registered, or inline ones kept by `reference_cache`) whose primed codec state
    # (about 5 MB each, on the engine's device) is kept, so their streams start without decoding the
    # reference codes; 0: prime every stream.
    primed_voices: int = 32
    # Inline references (`reference_audio`) whose voices are kept, by the recording's bytes and
    # transcript: one sent again is not encoded again, and an in-context one's primed codec state is
    # kept with the registered voices'. 0: encode every request's reference.
    reference_cache: int = 64
    # A shutdown in two steps: once this file exists the model takes no new request and, when no
    # stream is left, writes `<drain_file>.done` (`voxtriton serve` sets it; "" = none).
    drain_file: str = ""
    # SMs of the background codec lane (voxserve): a count, or a fraction of the GPU's (`lane_sms`).
    background_sms: str = "0.75"
    # voxserve: "shared" runs the backbone on the whole GPU at high stream priority, background-lane
    # kernels filling in around it; "exclusive" gives it only the SMs the background lane leaves.
    backbone_partition: str = "shared"
    # Codec calls each lane keeps in flight: with 2, the codec decodes one batch while the lane
    # gathers and sends the other, instead of idling through the lane's host work.
    lane_workers: int = 2
    # The tts process's GIL switch interval, in ms: the longest a thread back from a chunk send or a
    # codec call may wait for the GIL while the engine thread runs Python (`benchmarks/response_sends.py`).
    switch_interval_ms: float = 5.0
    codec_urgent_model: str = "codec_urgent"
    codec_background_model: str = "codec_background"
    cancellation_check_s: float = 0.2  # a sweep makes one round trip per open stream
    # The largest share of time the cancellation watcher may hold the service lock, which the engine
    # thread and the lanes wait out: after a hold it lets go (1 / share - 1) times as long. 1: no pacing.
    cancellation_lock_share: float = 0.1
    # Append one JSON line per chunk sent and per frame step ("" = off); for diagnosis.
    chunk_trace_path: str = ""
    cuda_graphs: bool = True
    # Decoder-layer projections in FP8 (compute capability 8.9 or newer): off | talker | all (talker
    # and code predictor). Fewer weight bytes per step, FP8 tensor cores; logits move slightly.
    fp8_weights: str = "off"
    # Keys and values in FP8, a scale per entry (compute capability 8.9 or newer): off | talker | on
    # (talker and code predictor). Decode attention reads half the bytes; logits move slightly.
    fp8_kv_cache: str = "off"
    # Before Triton marks the model ready, run one request per codec lane the policy uses, through BLS,
    # so the first client's request is served warm. Needs the model loaded after the server started.
    warmup: bool = True
    # Launch each frame step before handling the previous one's frames, so the GPU does not wait
    # for the host's bookkeeping and admissions (not with the serial policy). See engine/engine.py.
    engine_overlap: bool = True
    # While the scheduler starts streams with one frame (`scheduler_single_frame_start_streams`), take
    # a stream's first frame before the talker advances, halfway through its step. See engine/engine.py.
    early_first_frames: bool = True
    # Prefill prompts on a stream of their own, beside the frame step in flight (GPU; graph-sized prompts).
    prefill_overlap: bool = True
    graph_batch_sizes: str = "1,2,4,8,16,32,48,64,96,128,192,256"  # capped at max_streams
    graph_spans: str = "256,512,1024,2048"  # attention-span buckets, capped at max_positions
    prefill_graph_batch_sizes: str = "1,2,4,8"  # prompts admitted together (larger ones go in groups)
    prefill_graph_lengths: str = "32,64,128,256"  # prompt-length buckets; longer prompts prefill eagerly

    def graph_buckets(self) -> dict[str, list[int]]:
        """The shapes `FrameRunner.capture_graphs` captures."""
        return {
            "batch_sizes": int_list(self.graph_batch_sizes),
            "spans": int_list(self.graph_spans),
            "prefill_batch_sizes": int_list(self.prefill_graph_batch_sizes),
            "prefill_lengths": int_list(self.prefill_graph_lengths),
        }

    def check_model(self, max_positions: int) -> None:
        """ValueError if a request could run past the positions the model was trained for (its
        backbone's max_position_embeddings): RoPE there is untrained, and nothing would say so."""
        if self.max_positions > max_positions:
            raise ValueError(
                f"config.pbtxt parameter 'max_positions' must be at most {max_positions} for this "
                f"checkpoint (its backbone's max_position_embeddings), got {self.max_positions}"
            )

    def __post_init__(self):
        if self.max_draining < 0:
            raise ValueError(
                f"config.pbtxt parameter 'max_draining' must be 0 or more, got {self.max_draining}"
            )
        if self.cancellation_check_s <= 0:
            raise ValueError(
                "config.pbtxt parameter 'cancellation_check_s' must be positive, "
                f"got {self.cancellation_check_s}"
            )
        if not 0 < self.cancellation_lock_share <= 1:
            raise ValueError(
                f"config.pbtxt parameter 'cancellation_lock_share' must be above 0 and at most 1, "
                f"got {self.cancellation_lock_share}"
            )
        if self.backbone_partition not in ("exclusive", "shared"):
            raise ValueError(
                f"config.pbtxt parameter 'backbone_partition' must be exclusive or shared, "
                f"got {self.backbone_partition!r}"
            )
        check_lane_sms("background_sms", self.background_sms)
        if not 0.001 <= self.switch_interval_ms <= 1000:  # below 1 us Python rounds it to 0
            raise ValueError(
                f"config.pbtxt parameter 'switch_interval_ms' must be between 0.001 and 1000, "
                f"got {self.switch_interval_ms}"
            )
        if self.primed_voices < 0:
            raise ValueError(
                f"config.pbtxt parameter 'primed_voices' must be 0 or more, got {self.primed_voices}"
            )
        if self.drain_file and not Path(self.drain_file).parent.is_dir():
            raise ValueError(
                f"config.pbtxt parameter 'drain_file': its directory {Path(self.drain_file).parent} "
                "does not exist"
            )
        if self.reference_cache < 0:
            raise ValueError(
                f"config.pbtxt parameter 'reference_cache' must be 0 or more, got {self.reference_cache}"
            )
        if self.lane_workers < 1:
            raise ValueError(
                f"config.pbtxt parameter 'lane_workers' must be at least 1, got {self.lane_workers}"
            )
        if self.text_lookahead < 1:
            raise ValueError(
                f"config.pbtxt parameter 'text_lookahead' must be at least 1, got {self.text_lookahead}"
            )
        for name in ("text_idle_timeout_s", "text_stream_max_s"):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"config.pbtxt parameter {name!r} must be positive, got {getattr(self, name)}"
                )
        if self.fp8_weights not in FP8_SCOPES:
            raise ValueError(
                f"config.pbtxt parameter 'fp8_weights' must be off, talker or all, got {self.fp8_weights!r}"
            )
        if self.fp8_kv_cache not in FP8_KV_CACHE:
            raise ValueError(
                f"config.pbtxt parameter 'fp8_kv_cache' must be off, talker or on, got {self.fp8_kv_cache!r}"
            )
        if self.text_layout not in ("full", "interleaved"):
            raise ValueError(
                f"config.pbtxt parameter 'text_layout' must be full or interleaved, got {self.text_layout!r}"
            )

    @staticmethod
    def from_model_config(model_config: dict | str) -> tuple["TTSSettings", SchedulerConfig]:
        params = _parameters(model_config)
        _check_known(
            params,
            {f.name for f in dataclasses.fields(TTSSettings)}
            | {"scheduler_" + f.name for f in dataclasses.fields(SchedulerConfig)},
        )
        return _from_parameters(TTSSettings, params), _from_parameters(SchedulerConfig, params, "scheduler_")


@dataclass(frozen=True)
class CodecSettings:
    checkpoint_dir: str = ""
    device: str = "auto"
    dtype: str = "auto"  # bf16 on GPU, fp32 on CPU
    sm_count: str = "0"  # "0": the whole GPU; N: a green context of N SMs; a fraction: see `lane_sms`
    high_priority: bool = False  # whole-GPU lanes only: a high-priority CUDA stream (the urgent lane)
    # The tts lane this model serves, which sets its default graph shapes: "urgent" (also every
    # lane of the policies other than voxserve) or "background".
    lane: str = URGENT
    cuda_graphs: bool = True
    # Let cuDNN time its convolution algorithms per shape before each graph capture (with cuda_graphs
    # only): its heuristic picks a far slower fallback kernel for some dilated layers.
    cudnn_autotune: bool = True
    # CUDA-graph shapes (chunks per call, frames per chunk); empty: those the tts scheduler's default
    # chunk schedule and this lane's batch limit make (`codec_graph_shapes`).
    graph_batch_sizes: str = ""
    graph_frame_sizes: str = ""
    # Codecs that prime (Qwen3-TTS Base): the codec transformer's lengths captured at batch 1 for primings
    # (an in-context voice's reference codes, 125 frames for 10 s, run as the fewest of them; 1 lets
    # every length run so).
    graph_priming_sizes: str = "1,4,25,100"
    test_fault: str = ""  # test-only fault injection: "raise:N" | "exit:N" (not counting the warm-up's calls)

    def __post_init__(self):
        check_lane_sms("sm_count", self.sm_count)
        for name in ("graph_batch_sizes", "graph_frame_sizes", "graph_priming_sizes"):
            check_sizes(name, getattr(self, name))
        if self.lane not in (URGENT, BACKGROUND):
            raise ValueError(
                f"config.pbtxt parameter 'lane' must be {URGENT!r} or {BACKGROUND!r}, got {self.lane!r}"
            )

    def graph_shapes(self) -> tuple[list[int], list[int]]:
        """(batch sizes, frame sizes) to capture."""
        implied = codec_graph_shapes(lane=self.lane)
        return (
            int_list(self.graph_batch_sizes) or implied["graph_batch_sizes"],
            int_list(self.graph_frame_sizes) or implied["graph_frame_sizes"],
        )

    @staticmethod
    def from_model_config(model_config: dict | str) -> "CodecSettings":
        params = _parameters(model_config)
        _check_known(params, {f.name for f in dataclasses.fields(CodecSettings)})
        return _from_parameters(CodecSettings, params)


def check_lane_sms(name: str, value: str) -> None:
    """An SM count (0: the whole GPU; where a partition is required, the model refuses 0 on the GPU)
    or a fraction of the GPU's SMs between 0 and 1, such as 0.75."""
    try:
        fraction = float(value)
    except ValueError:
        fraction = -1.0
    if not (is_count(value) or 0 < fraction < 1):
        raise ValueError(
            f"config.pbtxt parameter {name!r} must be an SM count or a fraction of the GPU's SMs "
            f"between 0 and 1 (such as 0.75), got {value!r}"
        )


def is_count(value: str) -> bool:
    return value.isascii() and value.isdigit()


def lane_sms(value: str, total_sms: int) -> int:
    """SMs of a lane's partition on a GPU of `total_sms` SMs: a count as given, or a fraction of them
    rounded down to a multiple of 8 (green contexts come in groups of SMs), at least 8. On the H200's
    132 SMs 0.75 is 96 and 0.5 is 64."""
    if is_count(value):
        return int(value)
    return max(8, int(float(value) * total_sms) // 8 * 8)


def codec_graph_shapes(scheduler: SchedulerConfig | None = None, lane: str = URGENT) -> dict[str, list[int]]:
    """The shapes of the codec calls a tts scheduler makes on `lane` (None: the default scheduler's):
    a call holds chunks of one size of its schedule, up to the lane's batch limit. Every size of the
    schedule (on the urgent lane, which decodes first chunks, also a 1-frame start where
    `single_frame_start_streams` may allow one: a CPU captures no graphs); powers of two up to the
    limit, and the limit. The
    urgent model serves the urgent lane under every policy (serial's inline decodes too, at the same
    limit); only voxserve's background lane makes the larger calls, so only the background model
    captures them. (A call whose shape has no CUDA graph runs eagerly, several times slower.)"""
    scheduler = scheduler or SchedulerConfig()
    limit = scheduler.batch_limit(lane)
    one_frame_starts = lane == URGENT and scheduler.single_frame_start_streams != 0
    return {
        "graph_frame_sizes": sorted(set(scheduler.sizes) | ({1} if one_frame_starts else set())),
        "graph_batch_sizes": sorted(
            {1 << bit for bit in range(limit.bit_length()) if 1 << bit <= limit} | {limit}
        ),
    }


def check_sizes(name: str, value: str) -> None:
    """Comma-separated whole numbers of at least 1 (or nothing)."""
    if not all(item.strip().isdigit() and int(item) >= 1 for item in value.split(",") if item.strip()):
        raise ValueError(
            f"config.pbtxt parameter {name!r} must be comma-separated whole numbers >= 1, got {value!r}"
        )


def int_list(text: str) -> list[int]:
    return [int(item) for item in text.split(",") if item.strip()]


def cache_dir() -> Path:
    return Path(os.environ.get("VOXTRITON_CACHE", Path.home() / ".cache" / "voxtriton"))


def voices_dir(setting: str) -> Path:
    return Path(setting) if setting else cache_dir() / "voices"


def default_checkpoint_dir() -> Path:
    return cache_dir() / "checkpoints" / "tiny-seed0"


def visible_devices(value: str) -> list[str]:
    """The devices a CUDA_VISIBLE_DEVICES value names, in order. As CUDA reads it, the list ends at
    the first entry that is neither a non-negative index nor a GPU-/MIG- UUID ("", "-1" and
    "NoDevFiles" name none)."""
    devices = []
    for device in (entry.strip() for entry in value.split(",")):
        if not (device.isdigit() or device.startswith(("GPU-", "MIG-"))):
            break
        devices.append(device)
    return devices

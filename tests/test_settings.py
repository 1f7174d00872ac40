"""config.pbtxt parameters: typed, validated, and a bad one names itself."""

import pytest
import torch

from voxtriton.scheduler.policy import BACKGROUND, INLINE, URGENT
from voxtriton.serving.settings import CodecSettings, TTSSettings, lane_sms


def config(**parameters):
    return {"parameters": {key: {"string_value": value} for key, value in parameters.items()}}


def test_parameters_are_typed_and_scheduler_ones_go_to_the_scheduler():
    settings, scheduler = TTSSettings.from_model_config(
        config(cancellation_check_s="0.5", backbone_partition="exclusive", scheduler_policy="concurrent")
    )
    assert settings.cancellation_check_s == 0.5 and settings.backbone_partition == "exclusive"
    assert scheduler.policy == "concurrent"
    assert TTSSettings().warmup and not TTSSettings.from_model_config(config(warmup="false"))[0].warmup


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("backbone_partition", "half", "'backbone_partition' must be exclusive or shared"),
        ("cancellation_check_s", "fast", "'cancellation_check_s': cannot read 'fast' as float"),
        ("cancellation_check_s", "0", "'cancellation_check_s' must be positive"),
        ("cancellation_lock_share", "0", "'cancellation_lock_share' must be above 0 and at most 1, got 0.0"),
        (
            "cancellation_lock_share",
            "1.5",
            "'cancellation_lock_share' must be above 0 and at most 1, got 1.5",
        ),
        ("backbone_sms", "100", "unknown parameter(s) backbone_sms"),
        (
            "background_sms",
            "most",
            "'background_sms' must be an SM count or a fraction of the GPU's SMs between 0 and 1 "
            "(such as 0.75), got 'most'",
        ),
        ("background_sms", "1.5", "'background_sms' must be an SM count or a fraction"),
        ("scheduler_ttfa_target_s", "-0.1", "scheduler_ttfa_target_s must be >= 0, got -0.1"),
        ("lane_workers", "0", "'lane_workers' must be at least 1, got 0"),
        ("max_draining", "-1", "'max_draining' must be 0 or more, got -1"),
        ("primed_voices", "-2", "'primed_voices' must be 0 or more, got -2"),
        ("switch_interval_ms", "0", "'switch_interval_ms' must be between 0.001 and 1000, got 0.0"),
        ("switch_interval_ms", "inf", "'switch_interval_ms' must be between 0.001 and 1000, got inf"),
        (
            "scheduler_idle_urgent_takes_frames",
            "-1",
            "scheduler_idle_urgent_takes_frames must be >= 0, got -1",
        ),
    ],
)
def test_a_bad_parameter_is_refused_by_name(name, value, message):
    with pytest.raises(ValueError) as error:
        TTSSettings.from_model_config(config(**{name: value}))
    assert message in str(error.value)


def test_the_background_lane_is_three_quarters_of_the_gpu_by_default_in_groups_of_eight_sms():
    settings, _ = TTSSettings.from_model_config(config())
    assert settings.background_sms == "0.75" and lane_sms(settings.background_sms, 132) == 96  # H200
    assert lane_sms("0.5", 132) == 64 and lane_sms("0.5", 58) == 24 and lane_sms("0.5", 10) == 8
    assert lane_sms("40", 132) == 40 and lane_sms("0", 132) == 0
    assert CodecSettings.from_model_config(config(sm_count="0.5")).sm_count == "0.5"
    assert lane_sms(CodecSettings.from_model_config(config()).sm_count, 132) == 0  # the whole GPU
    for bad in ("-8", "1.0", "nan", "half", "²"):
        with pytest.raises(ValueError, match=f"'sm_count' must be an SM count or a fraction .*, got '{bad}'"):
            CodecSettings.from_model_config(config(sm_count=bad))


def test_the_codecs_capture_every_call_shape_the_default_scheduler_makes():
    """A codec call without a CUDA graph runs eagerly, several times slower: by default each codec
    captures every chunk size of the scheduler's default schedule and batch sizes up to its lane's
    limit (the urgent lane's also bounds serial's inline calls); the urgent lane also a GPU's
    default 1-frame start."""
    _, scheduler = TTSSettings.from_model_config(config())
    schedule = {int(size) for size in scheduler.chunk_schedule.split(",")}
    lanes = ((URGENT, scheduler.max_batch, {1}), (BACKGROUND, scheduler.background_max_batch, set()))
    for lane, limit, starts in lanes:
        batch_sizes, frame_sizes = CodecSettings.from_model_config(config(lane=lane)).graph_shapes()
        assert set(frame_sizes) == schedule | starts
        assert {limit, 1} <= set(batch_sizes) and max(batch_sizes) == limit
    assert scheduler.batch_limit(INLINE) == scheduler.max_batch  # serial's calls go to the urgent model
    # As docs/configuration.md says:
    assert CodecSettings.from_model_config(config()).graph_shapes() == (
        [1, 2, 4, 8, 16],
        [1, 2, 4, 8, 16, 25],
    )
    assert CodecSettings.from_model_config(config(lane="background")).graph_shapes() == (
        [1, 2, 4, 8, 16, 32, 64],
        [2, 4, 8, 16, 25],
    )
    given = CodecSettings.from_model_config(
        config(graph_batch_sizes="4,24", graph_frame_sizes="3")
    ).graph_shapes()
    assert given == ([4, 24], [3])
    with pytest.raises(ValueError, match="parameter 'lane' must be 'urgent' or 'background', got 'inline'"):
        CodecSettings.from_model_config(config(lane="inline"))
    bad_sizes = {"graph_frame_sizes": "2,x", "graph_batch_sizes": "0", "graph_priming_sizes": "-50"}
    for name, bad in bad_sizes.items():
        with pytest.raises(ValueError, match=f"'{name}' must be comma-separated whole numbers >= 1"):
            CodecSettings.from_model_config(config(**{name: bad}))


def test_auto_device_refuses_to_fall_back_to_the_cpu_on_a_gpu_host(monkeypatch, tmp_path):
    """A GPU host whose CUDA build of torch cannot use CUDA (CUDA_VISIBLE_DEVICES, MPS) must not
    quietly serve on the CPU; an explicit device=cpu still may, and so may CUDA_VISIBLE_DEVICES naming
    no GPU, a CPU-only build of torch or a host without a GPU."""
    from voxtriton.serving import runtime

    node = tmp_path / "nvidia0"
    node.touch()
    monkeypatch.setattr(runtime, "GPU_DEVICE_NODE", node)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")  # a CUDA build of torch
    refusal = (
        r"this host has a GPU .* set device=cpu for every model \(voxtriton serve --param .\*:device=cpu.\)"
    )
    with pytest.raises(ValueError, match=refusal):
        runtime.resolve_device("auto")
    assert runtime.resolve_device("cpu") == torch.device("cpu")
    for no_gpu_wanted in ("", "-1"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", no_gpu_wanted)
        assert runtime.resolve_device("auto") == torch.device("cpu")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(torch.version, "cuda", None)  # a CPU-only build (`make install`'s) runs on the CPU
    assert runtime.resolve_device("auto") == torch.device("cpu")
    monkeypatch.setattr(runtime, "GPU_DEVICE_NODE", tmp_path / "absent")
    assert runtime.resolve_device("auto") == torch.device("cpu")


@pytest.mark.parametrize(
    "value, devices",
    [
        ("0,1", ["0", "1"]),
        (" 2, 3 ", ["2", "3"]),
        ("0,,1", ["0"]),
        ("1,-1,0", ["1"]),
        ("", []),
        ("NoDevFiles", []),
        ("GPU-a,MIG-b", ["GPU-a", "MIG-b"]),
    ],
)
def test_cuda_visible_devices_is_read_as_cuda_reads_it(value, devices):
    from voxtriton.serving.settings import visible_devices

    assert visible_devices(value) == devices


@pytest.mark.parametrize("value", ["false", "true"])
def test_a_codec_without_cuda_graphs_never_autotunes_cudnn(tiny_checkpoint, value):
    """Autotuning happens in the warm-up calls before each graph capture; with no graphs (here: the
    CPU) every shape would pay it while serving. tests/test_gpu.py checks the GPU side."""
    from voxtriton.serving.codec_service import CodecService

    previous = torch.backends.cudnn.benchmark
    try:
        torch.backends.cudnn.benchmark = True
        CodecService(
            CodecSettings.from_model_config(
                config(checkpoint_dir=str(tiny_checkpoint), device="cpu", cudnn_autotune=value)
            )
        )
        assert torch.backends.cudnn.benchmark is False
    finally:
        torch.backends.cudnn.benchmark = previous

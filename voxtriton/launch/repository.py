"""The model repository: the packaged one, and its copy rendered with one server's parameters."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from ..scheduler import get_policy
from ..scheduler.policy import BACKGROUND, URGENT, SchedulerConfig
from ..serving.settings import codec_graph_shapes

# Package data in a wheel; in a source checkout a link to the top-level model_repository/.
REPOSITORY = Path(__file__).resolve().parents[1] / "model_repository"
CODEC_MODELS = {"codec_urgent": URGENT, "codec_background": BACKGROUND}  # model: the tts lane it serves
SECOND_GPU = "cuda:1"  # where a policy with `codec_on_second_gpu` puts the codec models


def _parameter_pattern(key: str) -> re.Pattern:
    """`parameters { key: "KEY" value: { string_value: "VALUE" } }`: groups prefix, key, value, suffix."""
    return re.compile(
        r'(parameters\s*\{\s*key:\s*"(' + key + r')"\s*value:\s*\{\s*string_value:\s*")([^"]*)(")'
    )


def set_parameter(config_text: str, key: str, value: str) -> str:
    """Replace (or append) `parameters { key: KEY value: { string_value: ... } }` in a config.pbtxt."""
    if '"' in value or "\\" in value:  # config.pbtxt would read them as the string's end or an escape
        raise ValueError(f"{key}: {value!r} holds a quote or a backslash, which a model's parameters cannot")
    pattern = _parameter_pattern(re.escape(key))
    line = f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}'
    if pattern.search(config_text):
        return pattern.sub(lambda m: m.group(1) + value + m.group(4), config_text)
    return config_text.rstrip("\n") + "\n" + line + "\n"


def read_parameters(config_text: str) -> dict[str, str]:
    """A config.pbtxt's string parameters, as Triton hands them to the model."""
    return {match.group(2): match.group(3) for match in _parameter_pattern(r"[^\"]+").finditer(config_text)}


def model_configs(repository: Path) -> dict[str, Path]:
    """model name: its config.pbtxt."""
    return {config.parent.name: config for config in sorted(repository.glob("*/config.pbtxt"))}


def render_repository(source: Path, target: Path, overrides: dict[str, dict[str, str]]) -> Path:
    """Copy the model repository, setting parameters per model ("*" applies to every model)."""
    shutil.copytree(source, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    for model, config in model_configs(target).items():
        text = config.read_text()
        for key, value in {**overrides.get("*", {}), **overrides.get(model, {})}.items():
            text = set_parameter(text, key, str(value))
        config.write_text(text)
    return target


def model_overrides(
    checkpoint: str | None, policy: str | None, gpus: int, parameters: dict[str, dict[str, str]]
) -> dict[str, dict[str, str]]:
    """Parameters per model of one server: its checkpoint, its policy on `gpus` GPUs, then `parameters`.
    A policy set as `tts:scheduler_policy` is the server's policy too, codec placement included."""
    given = parameters.get("tts", {}).get("scheduler_policy")
    if given and policy and given != policy:
        raise SystemExit(f"voxtriton: --policy {policy} and tts:scheduler_policy={given} disagree; set one")
    source = "tts:scheduler_policy" if given else "--policy"
    policy = given or policy
    try:
        second_gpu = bool(policy) and get_policy(policy).codec_on_second_gpu
    except ValueError as error:
        raise SystemExit(f"voxtriton: {source}: {error}") from None
    if not second_gpu:  # with a GPU of their own, the codec lanes need no partition
        parameters = align_background_partition(parameters)
    parameters = codec_graphs_for_the_scheduler(parameters)
    overrides: dict[str, dict[str, str]] = {"*": {}, "tts": {}}
    if checkpoint:
        overrides["*"]["checkpoint_dir"] = str(Path(checkpoint).resolve())
    if policy:
        overrides["tts"]["scheduler_policy"] = policy
    if second_gpu:
        if gpus >= 2:  # the codec lanes get the second GPU to themselves
            for model in CODEC_MODELS:
                overrides.setdefault(model, {}).update(device=SECOND_GPU, sm_count="0")
        else:
            print(f"voxtriton: policy {policy!r} needs two GPUs; the codec stays on the backbone's device")
    for model, values in parameters.items():
        overrides.setdefault(model, {}).update(values)
    return overrides


def align_background_partition(parameters: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """One setting, two readers: the background lane's size is `codec_background:sm_count` (its green
    context) and `tts:background_sms` (under `backbone_partition=exclusive`, the SMs the backbone
    leaves free). Setting either sets both, so the two partitions are sized from one number (the
    driver may still round each to its SM granularity); setting both differently is refused."""
    lane = parameters.get("codec_background", {}).get("sm_count")
    tts = parameters.get("tts", {}).get("background_sms")
    if lane is not None and tts is not None and lane != tts:
        raise SystemExit(
            f"voxtriton: codec_background:sm_count={lane} and tts:background_sms={tts} must agree "
            "(the background lane's SMs); set one of them"
        )
    if lane is None and tts is None:
        return parameters
    size = lane if lane is not None else tts
    aligned = {model: dict(values) for model, values in parameters.items()}
    aligned.setdefault("codec_background", {})["sm_count"] = size
    aligned.setdefault("tts", {})["background_sms"] = size
    return aligned


def codec_graphs_for_the_scheduler(parameters: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """The codecs' graph shapes follow the tts scheduler's chunk schedule and their lane's batch
    limit (`codec_graph_shapes`); their defaults follow the scheduler's defaults. When either is set
    for tts and a codec model's `graph_frame_sizes` / `graph_batch_sizes` is not, capture the shapes
    the setting implies."""
    tts = parameters.get("tts", {})
    keys = {
        "scheduler_chunk_schedule": "graph_frame_sizes",
        "scheduler_max_batch": "graph_batch_sizes",
        "scheduler_background_max_batch": "graph_batch_sizes",
        "scheduler_single_frame_start_streams": "graph_frame_sizes",
    }
    given = {setting.removeprefix("scheduler_"): tts[setting] for setting in keys if setting in tts}
    if not given:
        return parameters
    try:
        for limit in ("max_batch", "background_max_batch", "single_frame_start_streams"):
            if limit in given:
                given[limit] = int(given[limit])
        scheduler = SchedulerConfig(**given)
    except ValueError:  # the tts model refuses the setting itself, naming it
        return parameters
    aligned = {model: dict(values) for model, values in parameters.items()}
    for model, lane in CODEC_MODELS.items():
        shapes = codec_graph_shapes(scheduler, lane)
        implied = {key: shapes[key] for setting, key in keys.items() if setting in tts}
        set_for_model = {**parameters.get("*", {}), **parameters.get(model, {})}
        for key, sizes in implied.items():
            if key not in set_for_model:
                aligned.setdefault(model, {})[key] = ",".join(map(str, sizes))
    return aligned

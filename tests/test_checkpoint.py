"""make-checkpoint writes the official layout; the loader reads it, sharded or not, and refuses bad ones."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from voxtriton.models.config import CheckpointError, load_config
from voxtriton.models.loader import load_backbone, load_codec
from voxtriton.models.random_checkpoint import checkpoint_shapes, make_checkpoint, preset_configs

LISTING = Path(__file__).parent / "data" / "weight_map_0.6b_customvoice.md"


def official_listing() -> tuple[dict, dict]:
    """Tensor names/shapes of the real 0.6B CustomVoice checkpoint (third-party listing, see file)."""
    sections: dict[str, dict] = {"talker": {}, "codec": {}}
    current = None
    for line in LISTING.read_text().splitlines():
        if line.startswith("## Talker"):
            current = "talker"
        elif line.startswith("## Codec"):
            current = "codec"
        match = re.match(r"\[([\d, ]+)\]\s+\w+\s+(\S+)", line)
        if match and current:
            sections[current][match.group(2)] = tuple(int(x) for x in match.group(1).split(","))
    return sections["talker"], sections["codec"]


def write_configs(preset: str, directory: Path) -> Path:
    config, speech = preset_configs(preset)
    (directory / "speech_tokenizer").mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "speech_tokenizer" / "config.json").write_text(json.dumps(speech))
    shutil.copyfile(
        Path(__file__).parents[1] / "voxtriton/models/presets/common/generation_config.json",
        directory / "generation_config.json",
    )
    return directory


def test_official_tensor_layout_matches_real_checkpoint(tmp_path):
    talker, codec = checkpoint_shapes(write_configs("0.6b", tmp_path))
    official_talker, official_codec = official_listing()
    assert len(official_talker) == 402 and len(official_codec) == 496
    assert talker == official_talker
    assert codec == official_codec


def test_1_7b_layout_adds_the_predictor_projection(tmp_path):
    talker, _ = checkpoint_shapes(write_configs("1.7b", tmp_path))
    assert talker["talker.code_predictor.small_to_mtp_projection.weight"] == (1024, 2048)
    assert talker["talker.model.text_embedding.weight"] == (151936, 2048)
    assert len(talker) == 404


def test_tiny_checkpoint_files_and_dtypes(tiny_checkpoint):
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "vocab.json",
        "merges.txt",
        "tokenizer_config.json",
        "speech_tokenizer/config.json",
        "speech_tokenizer/model.safetensors",
    ):
        assert (tiny_checkpoint / name).is_file(), name
    talker = load_file(str(tiny_checkpoint / "model.safetensors"))
    codec = load_file(str(tiny_checkpoint / "speech_tokenizer/model.safetensors"))
    assert {t.dtype for t in talker.values()} == {torch.bfloat16}
    assert {t.dtype for t in codec.values()} == {torch.float32}
    config = load_config(tiny_checkpoint)
    assert config.model_type == "custom_voice" and config.codec.samples_per_frame == 1920


def test_same_seed_same_weights_and_other_seed_differs(tmp_path, tiny_checkpoint):
    again = make_checkpoint("tiny", tmp_path / "again", seed=0)
    other = make_checkpoint("tiny", tmp_path / "other", seed=5)
    name = "talker.model.layers.0.self_attn.q_proj.weight"
    first = load_file(str(tiny_checkpoint / "model.safetensors"))[name]
    assert torch.equal(first, load_file(str(again / "model.safetensors"))[name])
    assert not torch.equal(first, load_file(str(other / "model.safetensors"))[name])


def test_sharded_checkpoint_loads_identically(tmp_path, tiny_checkpoint):
    sharded = make_checkpoint("tiny", tmp_path / "sharded", seed=0, shard_mb=4)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 1
    whole, parts = load_backbone(tiny_checkpoint), load_backbone(sharded)
    for (name, a), (_, b) in zip(whole.state_dict().items(), parts.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.fixture
def broken(tmp_path, tiny_checkpoint):
    """A fresh copy of the tiny checkpoint to damage."""
    target = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, target)
    return target


def edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_missing_directory_and_files(tmp_path, broken):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_config(tmp_path / "nowhere")
    (broken / "speech_tokenizer" / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"speech_tokenizer/config.json: file is missing"):
        load_config(broken)


def test_missing_weights_file(broken):
    (broken / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model.safetensors: file is missing"):
        load_backbone(broken)


def test_missing_tensor_is_named(broken):
    path = broken / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["talker.model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path))
    with pytest.raises(
        CheckpointError, match=r"missing tensor\(s\) talker.model.layers.1.mlp.up_proj.weight \[128, 64\]"
    ):
        load_backbone(broken)


def test_shape_mismatch_is_named(broken):
    path = broken / "speech_tokenizer" / "model.safetensors"
    tensors = load_file(str(path))
    tensors["decoder.pre_conv.conv.weight"] = torch.zeros(64, 32, 5)
    save_file(tensors, str(path))
    with pytest.raises(
        CheckpointError, match=r"decoder.pre_conv.conv.weight has shape \[64, 32, 5\], expected \[64, 32, 3\]"
    ):
        load_codec(broken)


def test_corrupt_weights_file(broken):
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="cannot read safetensors file"):
        load_backbone(broken)


def test_missing_shard(tmp_path):
    sharded = make_checkpoint("tiny", tmp_path / "sharded", seed=0, shard_mb=4)
    next(sharded.glob("model-00002-of-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="shard listed in .* is missing"):
        load_backbone(sharded)


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            lambda c: c["talker_config"].update(hidden_act="gelu"),
            r"talker_config.hidden_act = 'gelu' is not supported \(expected 'silu'\)",
        ),
        (
            lambda c: c.update(tts_model_type="base"),
            r"config.json: speaker_encoder_config is missing",
        ),
        (
            lambda c: c.update(tts_model_type="base", speaker_encoder_config={"enc_dim": 32}),
            r"speaker_encoder_config.enc_dim = 32 is not supported \(expected 64, talker_config.hidden",
        ),
        (
            lambda c: c.update(tts_model_type="clone"),
            r"tts_model_type = 'clone' is not supported \(expected 'custom_voice' or 'voice_design' or 'b",
        ),
        (
            lambda c: c.update(tokenizer_type="qwen3_tts_tokenizer_25hz"),
            r"tokenizer_type = 'qwen3_tts_tokenizer_25hz' is not supported",
        ),
        (
            lambda c: c["talker_config"].update(num_key_value_heads=3),
            r"num_key_value_heads = 3 is not supported \(expected a divisor",
        ),
        (
            lambda c: c["talker_config"]["rope_scaling"].update(mrope_section=[4, 4, 4]),
            r"mrope_section .* summing to head_dim/2",
        ),
        (
            lambda c: c["talker_config"]["code_predictor_config"].update(num_hidden_layers=0),
            r"code_predictor_config.num_hidden_layers = 0",
        ),
        (lambda c: c.pop("tts_pad_token_id"), r"tts_pad_token_id = '<missing>' is not supported"),
    ],
)
def test_unsupported_config_values_are_named(broken, edit, message):
    edit_json(broken / "config.json", edit)
    with pytest.raises(CheckpointError, match=message):
        load_config(broken)


def test_unsupported_codec_config_is_named(broken):
    edit_json(broken / "speech_tokenizer" / "config.json", lambda c: c.update(decode_upsample_rate=960))
    with pytest.raises(CheckpointError, match=r"decode_upsample_rate = 960 is not supported \(expected 1920"):
        load_config(broken)


def test_invalid_json_is_named(broken):
    (broken / "generation_config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match=r"generation_config.json: not valid JSON"):
        load_config(broken)


def test_the_command_writes_into_a_new_or_empty_directory_only(tmp_path, capsys):
    """Files left in the directory (an index and shards, a tokenizer) would be read with or instead of
    the new ones, and a real checkpoint would be overwritten with noise."""
    from voxtriton.cli import main

    sharded = tmp_path / "sharded"
    assert main(["make-checkpoint", "--preset", "tiny", str(sharded), "--shard-mb", "1"]) == 0
    capsys.readouterr()
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for taken in (sharded, a_file):
        assert main(["make-checkpoint", "--preset", "tiny", str(taken), "--seed", "7"]) == 2
        assert capsys.readouterr().err == (
            f"voxtriton make-checkpoint: {str(taken)!r} is not an empty directory; name a new or empty one\n"
        )
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["make-checkpoint", "--preset", "tiny", str(empty), "--no-tokenizer"]) == 0
    assert (empty / "model.safetensors").is_file()

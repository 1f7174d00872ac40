"""CSM on a random-weight `csm-tiny` checkpoint: the layout transformers loads, and numerical parity
of our implementation with transformers' `CsmForConditionalGeneration` on the same files (fp32).

Logits agree to a relative error of 1e-4, greedy decoding gives identical codes, the Mimi decoder
gives the same waveform, decoding in chunks with carried state equals decoding whole, and the Mimi
encoder gives the same codes for context audio.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from sinks import CollectingSink

from voxtriton.cli import main
from voxtriton.errors import RequestError
from voxtriton.models.config import CheckpointError
from voxtriton.models.csm.checkpoint import TIED, checkpoint_shapes, make_csm_checkpoint, preset_config
from voxtriton.models.csm.config import load_csm_config
from voxtriton.models.csm.family import csm_family
from voxtriton.models.csm.loader import load_csm, load_mimi, load_mimi_encoder
from voxtriton.models.csm.prompt import CsmPromptBuilder, CsmTokenizer
from voxtriton.models.text import BYTE_TOKEN_ID

TEXT = "Hello world, this is a parity test."
FRAMES = 6
CODEC_FRAMES = 24


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours.float() - reference.float()).abs().max() / reference.float().abs().max()).item()


def greedy(logits: torch.Tensor, codebook: int) -> torch.Tensor:
    return logits.argmax(dim=-1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_csm_checkpoint("csm-tiny", tmp_path_factory.mktemp("csm-tiny"), seed=0)


@pytest.fixture(scope="module")
def reference(checkpoint):
    transformers = pytest.importorskip("transformers")
    model, info = transformers.CsmForConditionalGeneration.from_pretrained(
        str(checkpoint), dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    return model.eval(), info


@pytest.fixture(scope="module")
def ours(checkpoint):
    config = load_csm_config(checkpoint)
    return load_csm(checkpoint, config), load_mimi(checkpoint, config)


@pytest.fixture(scope="module")
def prompt(checkpoint):
    builder = CsmPromptBuilder(load_csm_config(checkpoint), CsmTokenizer(checkpoint))
    return torch.tensor([builder.build(TEXT, speaker=1)])


def test_transformers_loads_the_checkpoint_with_no_missing_or_unexpected_tensors(reference):
    model, info = reference
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set() and not info["error_msgs"]
    # The tied codebook table holds the same values under both names.
    assert torch.equal(
        model.backbone_model.embed_tokens.embed_audio_tokens.weight,
        model.depth_decoder.model.embed_tokens.weight,
    )


def test_the_1b_preset_has_the_official_sizes():
    config = preset_config("csm-1b")
    assert (config["hidden_size"], config["num_hidden_layers"], config["text_vocab_size"]) == (
        2048,
        16,
        128256,
    )
    depth = config["depth_decoder_config"]
    assert (depth["hidden_size"], depth["num_hidden_layers"], depth["max_position_embeddings"]) == (
        1024,
        4,
        33,
    )
    assert config["codec_config"]["num_quantizers"] == config["num_codebooks"] == 32


def test_the_1b_layout_is_what_transformers_builds(tmp_path):
    """Names and shapes of every tensor csm-1b writes, against transformers' model for the same config
    (built on the meta device: no weights are made)."""
    transformers = pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(preset_config("csm-1b")))
    config = transformers.AutoConfig.from_pretrained(str(tmp_path))
    with torch.device("meta"):
        model = transformers.CsmForConditionalGeneration(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert {name: tuple(shape) for name, shape in checkpoint_shapes(tmp_path).items()} == expected
    assert 1.5e9 < sum(math.prod(shape) for name, shape in expected.items() if name not in TIED) < 1.7e9


def test_prompt_is_the_official_text_layout(checkpoint, prompt):
    transformers = pytest.importorskip("transformers")
    official = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    assert prompt[0].tolist() == official(f"[1]{TEXT}")["input_ids"]
    ids = official.convert_tokens_to_ids(
        ["<|begin_of_text|>", "<|end_of_text|>", "<|AUDIO|>", "<|audio_eos|>"]
    )
    assert ids == [128000, 128001, 128002, 128003]
    # Bytes of the Llama 3 vocabulary between <|begin_of_text|> and <|end_of_text|>.
    assert prompt[0].tolist() == [128000, *(BYTE_TOKEN_ID[b] for b in f"[1]{TEXT}".encode()), 128001]


def test_special_tokens_in_text_stay_text(checkpoint):
    builder = CsmPromptBuilder(load_csm_config(checkpoint), CsmTokenizer(checkpoint))
    ids = builder.build("<|end_of_text|>")
    assert ids.count(128001) == 1 and ids[-1] == 128001


@pytest.mark.parametrize("speaker", ["x", -1, 1.5, "1a"])
def test_a_bad_speaker_is_refused_naming_the_field(checkpoint, speaker):
    builder = CsmPromptBuilder(load_csm_config(checkpoint), CsmTokenizer(checkpoint))
    with pytest.raises(RequestError) as error:
        builder.build(TEXT, speaker=speaker)
    assert error.value.field == "speaker"


def test_backbone_logits_match(reference, ours, prompt):
    model, _ = reference
    csm, _ = ours
    with torch.inference_mode():
        expected = model(input_ids=prompt).logits[:, -1]
        cache, _ = csm.new_caches(1, prompt.shape[1])
        positions = torch.arange(prompt.shape[1])[None]
        _, logits = csm(csm.text_embeds(prompt), positions, cache, prompt.shape[1])
    assert relative_error(logits, expected) <= 1e-4


def test_depth_decoder_logits_match(reference, ours):
    """Teacher-forced over one frame: the 31 codebook logits from a backbone state and codes."""
    model, _ = reference
    csm, _ = ours
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(2, csm.config.backbone.hidden_size, generator=generator)
    codes = torch.randint(0, 2048, (2, 32), generator=generator)
    with torch.inference_mode():
        inputs = torch.nn.functional.pad(codes[:, :-1], (1, 0))
        expected = model.depth_decoder(input_ids=inputs, backbone_last_hidden_state=hidden).logits
        recorded = []

        def teacher(logits, codebook):
            recorded.append(logits)
            return codes[:, codebook]

        _, (keys, values) = csm.new_caches(2, 1)
        predicted = csm.depth_decoder.predict_frame(hidden, codes[:, 0], keys, values, teacher)
    assert torch.equal(predicted, codes[:, 1:])
    assert len(recorded) == 31
    for codebook, logits in enumerate(recorded, start=1):
        assert relative_error(logits, expected[:, codebook - 1]) <= 1e-4, f"codebook {codebook}"


def test_greedy_codes_match(reference, ours, prompt):
    model, _ = reference
    csm, _ = ours
    with torch.inference_mode():
        expected = model.generate(
            input_ids=prompt, max_new_tokens=FRAMES, do_sample=False, depth_decoder_do_sample=False
        )
        codes = csm.generate(prompt, FRAMES, greedy)
    assert expected.shape == (1, FRAMES, 32)
    assert torch.equal(codes, expected)


@pytest.fixture(scope="module")
def codec_codes():
    return torch.randint(0, 2048, (2, CODEC_FRAMES, 32), generator=torch.Generator().manual_seed(11))


def test_mimi_waveform_matches_reference(reference, ours, codec_codes):
    model, _ = reference
    _, mimi = ours
    with torch.inference_mode():
        expected = model.codec_model.decode(codec_codes.transpose(1, 2)).audio_values[:, 0]
    wav, _ = mimi.decode(codec_codes, torch.zeros(2, dtype=torch.long), mimi.new_state(2))
    assert wav.shape == expected.shape == (2, CODEC_FRAMES * 1920)
    assert expected.abs().max() > 0.05  # a real signal, not silence
    assert (wav - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("schedule", [[1] * CODEC_FRAMES, [5] * 5, [3, 1, 7, 2, 11]], ids=["1", "5", "mixed"])
def test_mimi_chunked_equals_whole(ours, codec_codes, schedule):
    """Chunks past the attention window (8 transformer steps in csm-tiny, 4 frames) included."""
    _, mimi = ours
    whole, _ = mimi.decode(codec_codes, torch.zeros(2, dtype=torch.long), mimi.new_state(2))
    state, start, pieces = mimi.new_state(2), 0, []
    for size in schedule:
        chunk = codec_codes[:, start : start + size]
        wav, state = mimi.decode(chunk, torch.full((2,), start), state)
        pieces.append(wav)
        start += chunk.shape[1]
    assert start == CODEC_FRAMES
    assert (torch.cat(pieces, dim=1) - whole).abs().max().item() <= 1e-4


def test_mimi_rows_are_independent(ours, codec_codes):
    _, mimi = ours
    both, _ = mimi.decode(codec_codes, torch.zeros(2, dtype=torch.long), mimi.new_state(2))
    second, _ = mimi.decode(codec_codes[1:], torch.zeros(1, dtype=torch.long), mimi.new_state(1))
    assert (both[1:] - second).abs().max().item() <= 1e-5


@pytest.mark.parametrize("samples", [24000, 2 * 24000 + 777, 13 * 1920])
def test_mimi_encoder_codes_equal_transformers_encode(reference, checkpoint, samples):
    """24 kHz audio -> 32 codebooks at 12.5 Hz: one frame per started 1920 samples, as transformers'
    `MimiModel.encode` (SEANet encoder, encoder transformer, downsample, split RVQ)."""
    model, _ = reference
    encoder = load_mimi_encoder(checkpoint)
    audio = torch.randn(2, samples, generator=torch.Generator().manual_seed(samples)) * 0.3
    with torch.inference_mode():
        expected = model.codec_model.encode(audio[:, None]).audio_codes.transpose(1, 2)
        codes = encoder(audio)
    assert codes.shape == (2, -(-samples // 1920), 32)
    assert torch.equal(codes, expected)
    assert all(len(codes[0, :, k].unique()) > 1 for k in range(32))  # not a constant code


def test_loader_names_the_file_and_tensor(checkpoint, tmp_path):
    tensors = load_file(str(checkpoint / "model.safetensors"))
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    broken = dict(tensors)
    del broken["depth_decoder.codebooks_head.weight"]
    save_file(broken, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: missing tensor\(s\) depth_decoder\.codebooks_head"
    ):
        load_csm(tmp_path)
    broken = dict(tensors)
    name = "codec_model.decoder.layers.0.conv.weight"
    broken[name] = broken[name][:, :-1].contiguous()
    save_file(broken, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: tensor codec_model\.decoder\.layers\.0\.conv\.weight has shape",
    ):
        load_mimi(tmp_path)
    broken = dict(tensors)
    del broken["codec_model.encoder_transformer.layers.1.mlp.fc2.weight"]
    save_file(broken, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors \(tensors under 'codec_model\.'\): missing tensor\(s\) "
        r"encoder_transformer\.layers\.1\.mlp\.fc2\.weight",
    ):
        load_mimi_encoder(tmp_path)
    broken = dict(tensors)
    name = "codec_model.quantizer.acoustic_residual_vector_quantizer.input_proj.weight"
    broken[name] = broken[name][:-1].contiguous()
    save_file(broken, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: tensor codec_model\.quantizer\.\S+\.input_proj\.weight has shape",
    ):
        load_mimi_encoder(tmp_path)


def test_a_config_saved_by_transformers_5_reads_as_the_official_one(checkpoint, tmp_path):
    """transformers 5 saves RoPE as `rope_parameters` (a fine-tuned checkpoint's config): the same
    backbone, depth decoder and codec as from the official `rope_theta` and `rope_scaling`."""
    transformers = pytest.importorskip("transformers")
    transformers.CsmConfig.from_pretrained(str(checkpoint)).save_pretrained(str(tmp_path))
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in saved and "rope_theta" not in saved  # the layout read here
    assert load_csm_config(tmp_path) == load_csm_config(checkpoint)


def test_config_errors_name_the_field(checkpoint, tmp_path):
    config = json.loads((checkpoint / "config.json").read_text())
    config["codec_config"]["num_quantizers"] = 16
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="config.json: num_codebooks"):
        load_csm_config(tmp_path)
    config["codec_config"]["num_quantizers"] = 32
    config["rope_scaling"]["rope_type"] = "yarn"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="rope_scaling.rope_type"):
        load_csm_config(tmp_path)


def test_family_describes_the_checkpoint(checkpoint):
    family = csm_family(checkpoint)
    assert (family.sample_rate, family.frame_rate, family.samples_per_frame) == (24000, 12.5, 1920)
    assert (family.codebooks, family.depth_steps, family.predictor_positions) == (32, 31, 32)
    # generation_config.json: sampling with temperature 0.9 and top-k 50 on both transformers.
    sampling = family.sampling
    assert (sampling.temperature, sampling.top_k, sampling.depth_temperature, sampling.depth_top_k) == (
        0.9,
        50,
        0.9,
        50,
    )
    assert sampling.max_frames == 125
    family.check_fields({"text", "speaker", "seed", "max_frames"})
    with pytest.raises(RequestError) as error:
        family.check_fields({"text", "language"})
    assert error.value.field == "language"
    end = torch.zeros(2, 32, dtype=torch.long)
    end[1, 3] = 7
    end[0, 31] = 5  # the last codebook does not count, as in transformers
    assert family.is_end(end).tolist() == [True, False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_the_cpu(checkpoint, ours, prompt, codec_codes):
    """CUDA (Triton rotary and decode-attention kernels, cuDNN) against the CPU, both fp32: backbone
    and depth-decoder logits, then the Mimi decoder chunked with carried state. cuDNN convolutions may
    use TF32, hence the codec's tolerance."""
    csm_cpu, mimi_cpu = ours
    config = load_csm_config(checkpoint)
    csm = load_csm(checkpoint, config, device="cuda")
    mimi = load_mimi(checkpoint, config, device="cuda")
    recorded = {"cpu": [], "cuda": []}

    def recorder(side):
        def sample(logits, codebook):
            recorded[side].append(logits.float().cpu())
            return logits.argmax(dim=-1)

        return sample

    with torch.inference_mode():
        codes = csm_cpu.generate(prompt, FRAMES, recorder("cpu"))
        csm.generate(prompt.cuda(), FRAMES, recorder("cuda"))
    assert len(recorded["cuda"]) == FRAMES * 32
    for step, (theirs, mine) in enumerate(zip(recorded["cpu"], recorded["cuda"])):
        assert relative_error(mine, theirs) <= 1e-4, f"logits of frame {step // 32}, codebook {step % 32}"
    assert codes.shape == (1, FRAMES, 32)
    state_gpu, state_cpu, offset = mimi.new_state(2), mimi_cpu.new_state(2), 0
    for size in (2, 5, 17):
        chunk, start = codec_codes[:, offset : offset + size], torch.full((2,), offset)
        audio_gpu, state_gpu = mimi.decode(chunk.cuda(), start.cuda(), state_gpu)
        audio_cpu, state_cpu = mimi_cpu.decode(chunk, start, state_cpu)
        error = (audio_gpu.cpu() - audio_cpu).norm() / audio_cpu.norm()
        assert error < 1e-2, f"chunk of {size} frames: relative error {error:.2e}"
        offset += size


def test_cli_writes_csm_tiny_and_the_byte_fallback_gives_the_tokenizer_ids(checkpoint, tmp_path, prompt):
    assert main(["make-checkpoint", "--preset", "csm-tiny", str(tmp_path), "--no-tokenizer"]) == 0
    assert (tmp_path / "model.safetensors").is_file() and not (tmp_path / "tokenizer.json").exists()
    builder = CsmPromptBuilder(load_csm_config(tmp_path), CsmTokenizer(tmp_path))
    assert builder.build(TEXT, speaker="1") == prompt[0].tolist()
    with pytest.raises(SystemExit, match="--shard-mb"):
        main(["make-checkpoint", "--preset", "csm-tiny", str(tmp_path), "--shard-mb", "10"])


# -- the engine: CSM behind the model-family interface ------------------------------------------------


def engine_codes(engine, requests, *, stagger: bool = False) -> dict[str, list]:
    """Run requests to their ends (`stagger`: each joins one step after the one before); returns each
    request's frames [frames, K] and its finish reasons."""
    frames, reasons, pending = {r.request_id: [] for r in requests}, {}, list(requests)
    while pending or engine.has_work:
        if pending:
            for request in pending[:1] if stagger else pending:
                engine.add(request)
            pending = pending[1:] if stagger else []
        for output in engine.step():
            if output.codes is not None:  # None: the request ended before its first frame
                frames[output.request.request_id].append(output.codes)
            if output.finish_reason:
                reasons[output.request.request_id] = output.finish_reason
    codebooks = engine.runner.codebooks
    return {
        key: (torch.tensor(np.array(value)).reshape(len(value), codebooks), reasons.get(key))
        for key, value in frames.items()
    }


def csm_request(family, request_id: str, text: str, speaker=1, **params):
    from voxtriton.engine.request import GenerationParams, Request

    return Request(
        request_id,
        family.prompt.prompt(text, speaker),
        GenerationParams.create(family.sampling, 1000, **params),
    )


@pytest.fixture(scope="module")
def family(checkpoint):
    from voxtriton.models.families import load_family

    return load_family(checkpoint)


def new_engine(family, ours, rows=3, is_end=None, overlap=False):
    from voxtriton.engine.csm_runner import CsmRunner
    from voxtriton.engine.engine import Engine

    if is_end is None:
        runner = family.new_runner(ours[0], rows, 256, 64)
    else:
        runner = CsmRunner(ours[0], is_end, rows, 256, 64)
    return Engine(runner, rows, overlap=overlap)


def test_a_server_allowing_more_positions_than_the_model_was_trained_for_is_refused(checkpoint, family):
    from voxtriton.serving.settings import TTSSettings

    TTSSettings(checkpoint_dir=str(checkpoint), max_positions=2048).check_model(family.max_positions)
    with pytest.raises(ValueError, match="'max_positions' must be at most 2048 for this checkpoint"):
        TTSSettings(checkpoint_dir=str(checkpoint), max_positions=4096).check_model(family.max_positions)


def test_the_registry_picks_csm_from_the_checkpoint_config(family):
    assert family.name == "csm" and family.codebooks == 32 and family.samples_per_frame == 1920
    assert not family.input_streaming and family.clones_voices  # a voice is a context turn


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_engine_greedy_codes_equal_transformers_generate(reference, family, ours, prompt, overlap):
    """The engine's frame steps (backbone step + depth decoder, batched with other requests that join
    at other steps) give transformers' greedy codes for the same prompt on the same random weights."""
    model, _ = reference
    with torch.inference_mode():
        expected = model.generate(
            input_ids=prompt, max_new_tokens=FRAMES, do_sample=False, depth_decoder_do_sample=False
        )[0]
    engine = new_engine(family, ours, overlap=overlap)
    requests = [
        csm_request(family, "other", "A longer sentence that shares the batch.", 0, seed=3, max_frames=9),
        csm_request(family, "parity", TEXT, 1, temperature=0.0, max_frames=FRAMES),
        csm_request(family, "short", "Hi.", 2, temperature=0.0, max_frames=4),
    ]
    assert requests[1].prompt.text_ids == prompt[0].tolist()
    results = engine_codes(engine, requests, stagger=True)
    codes, reason = results["parity"]
    assert reason == "max_frames"
    assert torch.equal(codes, expected)
    assert results["other"][0].shape == (9, 32) and results["short"][0].shape == (4, 32)


@pytest.mark.parametrize("lengths", [[16, 48], [16, 32]], ids=["padded", "longer-than-buckets"])
def test_prefills_padded_to_buckets_give_the_exact_shape_codes(reference, family, ours, prompt, lengths):
    """Prompts padded to prefill buckets (admitted in groups of at most 2, the last with a padding row)
    give the greedy codes of exact-shape prefills, and transformers' own; prompts longer than every
    length bucket prefill eagerly at their exact shapes."""
    model, _ = reference
    with torch.inference_mode():
        expected = model.generate(
            input_ids=prompt, max_new_tokens=FRAMES, do_sample=False, depth_decoder_do_sample=False
        )[0]

    def requests():
        return [
            csm_request(
                family,
                "other",
                "A longer sentence that shares the batch.",
                0,
                max_frames=FRAMES,
                temperature=0.0,
            ),
            csm_request(family, "parity", TEXT, 1, max_frames=FRAMES, temperature=0.0),
            csm_request(family, "short", "Hi.", 2, max_frames=4, temperature=0.0),
        ]

    padded, _ = padded_prefills_equal_exact_ones(family, ours, requests, lengths)
    assert torch.equal(padded["parity"][0], expected)


def padded_prefills_equal_exact_ones(family, ours, requests, lengths: list[int]):
    """Run `requests()` with exact-shape prefills, then with prefills padded to `lengths` in groups of
    2; checks that each request gets the same codes; returns the padded run's results and runner."""
    exact = engine_codes(new_engine(family, ours), requests())
    engine = new_engine(family, ours)
    engine.runner.set_buckets([], [], prefill_batch_sizes=[2], prefill_lengths=lengths)
    padded = engine_codes(engine, requests())
    for name, (codes, _) in exact.items():
        assert torch.equal(padded[name][0], codes), name
    return padded, engine.runner


def test_sampled_codes_depend_on_the_seed_not_the_batch(family, ours):
    alone = engine_codes(new_engine(family, ours), [csm_request(family, "a", TEXT, seed=7, max_frames=5)])
    batched = engine_codes(
        new_engine(family, ours),
        [
            csm_request(family, "b", "Something else entirely.", seed=1, max_frames=8),
            csm_request(family, "a", TEXT, seed=7, max_frames=5),
        ],
        stagger=True,
    )
    assert torch.equal(alone["a"][0], batched["a"][0])
    other = engine_codes(new_engine(family, ours), [csm_request(family, "a", TEXT, seed=8, max_frames=5)])
    assert not torch.equal(alone["a"][0], other["a"][0])
    assert int(alone["a"][0].max()) < family.codec_vocab  # only codes the codec decodes


def ends_at(frame: torch.Tensor):
    """An end rule that matches `frame` alone."""
    return lambda codes: (codes == frame.to(codes.device)).all(dim=1)


@pytest.mark.parametrize("end", [3, 1, 0])
def test_the_end_frame_ends_the_request_and_is_not_returned(family, ours, end):
    """With an end rule that matches the greedy frame `end`, the request returns the frames before
    it, the last with reason eos (none at all when the first frame is the end, as transformers'
    generate returns none); ignore_eos keeps going to max_frames."""
    greedy = engine_codes(
        new_engine(family, ours), [csm_request(family, "g", TEXT, temperature=0.0, max_frames=6)]
    )
    frames = greedy["g"][0]
    is_end = ends_at(frames[end])

    for overlap in (False, True):
        ended = engine_codes(
            new_engine(family, ours, is_end=is_end, overlap=overlap),
            [csm_request(family, "e", TEXT, temperature=0.0, max_frames=6)],
        )
        codes, reason = ended["e"]
        assert reason == "eos" and torch.equal(codes, frames[:end])
    kept = engine_codes(
        new_engine(family, ours, is_end=is_end),
        [csm_request(family, "k", TEXT, temperature=0.0, max_frames=6, ignore_eos=True)],
    )
    assert kept["k"][1] == "max_frames" and torch.equal(kept["k"][0], frames)


def test_a_stream_whose_first_frame_is_the_end_ends_with_no_audio_and_no_error(checkpoint, family, ours):
    """Through the service (engine thread, scheduler, a CPU codec lane): the final response holds no
    audio, and the next request of the same service is served."""
    from voxtriton.scheduler.policy import URGENT, SchedulerConfig
    from voxtriton.serving.codec_service import CodecService, InProcessLane
    from voxtriton.serving.requests import request_parser
    from voxtriton.serving.settings import CodecSettings, TTSSettings
    from voxtriton.serving.state_pool import CodecStatePool
    from voxtriton.serving.tts_service import TTSService, codec_slots

    settings = TTSSettings(checkpoint_dir=str(checkpoint), max_streams=2, max_positions=256)
    parser, scheduler_config = request_parser(family, settings), SchedulerConfig(policy="concurrent")
    inputs = {"text": np.array([TEXT.encode()], dtype=object), "seed": np.array([3])}
    two = {**inputs, "max_frames": np.array([2], np.int32)}
    first = engine_codes(new_engine(family, ours), [parser.parse("first", two)])["first"][0][0]
    engine = new_engine(family, ours, rows=2, is_end=ends_at(first))
    codec = CodecService(CodecSettings(checkpoint_dir=str(checkpoint), device="cpu"))
    pool = CodecStatePool(codec_slots(engine, 1, scheduler_config), codec.state_size, "cpu")
    service = TTSService(engine, scheduler_config, {URGENT: InProcessLane(codec, pool.tensor)}, max_queued=1)
    try:
        sinks = {}
        for name, frames in (("ends", 4), ("speaks", 4)):
            sinks[name] = CollectingSink()
            other = {} if name == "ends" else {"ignore_eos": np.array([True])}
            request = {**inputs, **other, "max_frames": np.array([frames], np.int32)}
            service.submit(parser.parse(name, request), sinks[name])
            assert sinks[name].done.wait(60)
        assert [len(audio) for audio in sinks["ends"].audio] == [0] and sinks["ends"].errors == []
        assert sum(len(audio) for audio in sinks["speaks"].audio) == 4 * family.samples_per_frame
    finally:
        service.shutdown()


def test_serve_preflight_takes_a_csm_checkpoint_and_names_a_missing_file(checkpoint, tmp_path):
    from voxtriton.launch.preflight import check_checkpoint

    check_checkpoint(str(checkpoint))  # a CSM checkpoint has no speech_tokenizer/: not asked for
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    with pytest.raises(SystemExit, match="model.safetensors or model.safetensors.index.json is missing"):
        check_checkpoint(str(tmp_path))


# -- a context turn: a voice from reference audio -------------------------------------------------------

CONTEXT_TEXT = "This is what the reference says."


@pytest.fixture(scope="module")
def context_audio():
    """1.2 s of noise at 24 kHz (random weights: any signal makes codes): 15 context frames."""
    return (torch.randn(28800, generator=torch.Generator().manual_seed(21)) * 0.3).numpy()


@pytest.fixture(scope="module")
def context_voice(checkpoint, context_audio):
    from voxtriton.models.voice import Voice

    with torch.inference_mode():
        codes = load_mimi_encoder(checkpoint)(torch.from_numpy(context_audio)[None])[0]
    return Voice(np.zeros(0, np.float32), codes.numpy().astype(np.int64), CONTEXT_TEXT)


@pytest.fixture(scope="module")
def context_expected(reference, checkpoint, context_audio):
    """transformers' greedy codes for the conversation [speaker 1: CONTEXT_TEXT + its audio], then
    [speaker 1: TEXT]: the processor's layout of CSM's chat template, the audio encoded by its codec."""
    transformers = pytest.importorskip("transformers")
    model, _ = reference
    processor = transformers.AutoProcessor.from_pretrained(str(checkpoint))
    conversation = (
        f"<|begin_of_text|>[1]{CONTEXT_TEXT}<|end_of_text|><|AUDIO|><|audio_eos|>"
        f"<|begin_of_text|>[1]{TEXT}<|end_of_text|>"
    )
    inputs = processor(conversation, audio=[context_audio])
    with torch.inference_mode():
        codes = model.generate(
            **inputs, max_new_tokens=FRAMES, do_sample=False, depth_decoder_do_sample=False
        )
    return inputs["input_ids"][0].tolist(), codes[0]


def test_context_prompt_is_the_processors_conversation(family, context_voice, context_expected):
    prompt = family.prompt.prompt(TEXT, 1, context_voice)
    ids, _ = context_expected
    assert prompt.text_ids == ids
    frames = len(context_voice.codes)
    assert frames == 15 and prompt.context_position + frames + 1 == ids.index(128000, 1)
    assert prompt.context_codes.shape == (frames + 1, 32) and not prompt.context_codes[-1].any()
    assert prompt.text_tokens == len(ids) - frames - 1


def test_a_context_turn_needs_its_words(family, context_voice):
    import dataclasses

    with pytest.raises(RequestError) as error:
        family.prompt.prompt(TEXT, 1, dataclasses.replace(context_voice, text=None))
    assert error.value.field == "reference_text" and "required" in str(error.value)


def test_a_context_turn_whose_words_make_the_prompt_too_long_is_named(checkpoint, family, context_voice):
    """Under max_text_tokens alone, the text is accepted; with a long transcript before it, the
    error names reference_text (it named text, which the client had kept short)."""
    import dataclasses

    from voxtriton.serving.requests import request_parser
    from voxtriton.serving.settings import TTSSettings

    parser = request_parser(family, TTSSettings(checkpoint_dir=str(checkpoint), max_text_tokens=64))
    long_words = dataclasses.replace(context_voice, text="words " * 20)
    inputs = {"text": np.array([b"Hi."], dtype=object), "reference_text": np.array([b"..."], dtype=object)}
    parser.parse("short", inputs, context_voice)
    with pytest.raises(RequestError) as error:
        parser.parse("long", inputs, long_words)
    assert str(error.value) == "reference_text: too long: its words with the text are over 64 tokens"
    with pytest.raises(RequestError) as error:
        parser.parse("text", {"text": np.array([b"word " * 80], dtype=object)}, context_voice)
    assert error.value.field == "text"


def context_request(family, request_id, voice, **params):
    from voxtriton.engine.request import GenerationParams, Request

    prompt = family.prompt.prompt(TEXT, 1, voice)
    return Request(request_id, prompt, GenerationParams.create(family.sampling, 1000, **params))


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_engine_with_a_context_turn_equals_transformers_generate(
    family, ours, context_voice, context_expected, overlap
):
    """The context turn's frames enter the prefill as frame embeddings; greedy codes equal transformers'
    generate on the same conversation, while requests without context share the batch."""
    _, expected = context_expected
    requests = [
        csm_request(family, "other", "A longer sentence that shares the batch.", 0, seed=3, max_frames=9),
        context_request(family, "context", context_voice, temperature=0.0, max_frames=FRAMES),
        csm_request(family, "plain", TEXT, 1, temperature=0.0, max_frames=FRAMES),
    ]
    results = engine_codes(new_engine(family, ours, overlap=overlap), requests, stagger=True)
    assert torch.equal(results["context"][0], expected)
    assert not torch.equal(results["plain"][0], expected)  # the context turn changes the codes


@pytest.mark.parametrize("lengths", [[32, 96], [16, 32]], ids=["padded", "longer-than-buckets"])
def test_context_prefills_padded_to_buckets_give_the_same_codes(
    family, ours, context_voice, context_expected, lengths
):
    """A context prompt padded to a prefill bucket beside a plain one (the extra-embedding buffer holds
    its frames for that prefill only), or prefilled eagerly when no bucket fits: the same codes."""
    _, expected = context_expected

    def requests():
        return [
            csm_request(family, "plain", TEXT, 1, temperature=0.0, max_frames=FRAMES),
            context_request(family, "context", context_voice, temperature=0.0, max_frames=FRAMES),
            csm_request(family, "after", "Hi.", 2, temperature=0.0, max_frames=4),
        ]

    padded, runner = padded_prefills_equal_exact_ones(family, ours, requests, lengths)
    assert torch.equal(padded["context"][0], expected)
    assert runner.prefill_extra is not None and not runner.prefill_extra.any()


def test_voices_add_stores_a_csm_context_turn_that_a_request_names(checkpoint, family, tmp_path, capsys):
    """`voxtriton voices add` on a CSM checkpoint stores the recording's codes and words; the request
    parser then speaks with them (speaker 0). A recording without its words, or a voice named like a
    speaker id, is refused naming the field."""
    import soundfile

    from voxtriton.serving.requests import request_parser
    from voxtriton.serving.settings import TTSSettings
    from voxtriton.serving.voices import VoiceEncoder, VoiceStore

    wav = tmp_path / "reference.wav"
    audio = (torch.randn(30000, generator=torch.Generator().manual_seed(8)) * 0.3).numpy()
    soundfile.write(wav, audio, 24000, subtype="FLOAT")
    common = ["--audio", str(wav), "--checkpoint", str(checkpoint), "--voices-dir", str(tmp_path)]
    assert main(["voices", "add", "anna", *common]) == 2
    assert "text: is required: CSM's voice is a context turn" in capsys.readouterr().err
    assert main(["voices", "add", "7", *common, "--text", CONTEXT_TEXT]) == 2
    assert "name: '7' is a CSM speaker id" in capsys.readouterr().err
    assert main(["voices", "add", "anna", *common, "--text", CONTEXT_TEXT]) == 0
    store = VoiceStore(tmp_path, family)
    voice = store.get("anna")
    expected = VoiceEncoder(family).encode([audio], [CONTEXT_TEXT])[0]
    assert voice.text == CONTEXT_TEXT and np.array_equal(voice.codes, expected.codes)
    inputs = {"text": np.array([TEXT.encode()], dtype=object), "speaker": np.array([b"anna"], dtype=object)}
    request = request_parser(family, TTSSettings(), store).parse("r", inputs)
    assert request.prompt.text_ids == family.prompt.prompt(TEXT, 0, voice).text_ids
    assert np.array_equal(request.prompt.context_codes[:-1], voice.codes)


def test_the_ready_hint_of_a_csm_checkpoint_speaks_without_registering_a_voice(checkpoint):
    """CSM clones voices but speaks by speaker id too: `voxtriton serve`'s hint is one command."""
    from voxtriton.launch.serve import first_request_hint

    hint = first_request_hint(str(checkpoint), "127.0.0.1:8001", {})
    assert hint.startswith("  try: ") and "speak" in hint and "\n" not in hint and "voices add" not in hint

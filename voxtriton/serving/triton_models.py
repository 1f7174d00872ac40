"""Triton Python-backend glue for the `tts` scheduler model and the `codec_*` lane models.

Imported only inside Triton's Python stub (it needs triton_python_backend_utils). Tensors cross
the boundary through DLPack from torch: on Triton 2.51 tensors built from numpy arrays came back
empty or corrupted (outputs and BLS inputs alike), so nothing here builds a pb_utils.Tensor from numpy.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import subprocess
import sys
import threading
import time

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from ..engine.engine import Engine
from ..errors import RequestError, ServerBusy
from ..models.families import load_family
from ..models.fp8 import fp8_kv_runner_options
from ..scheduler.policy import BACKGROUND, URGENT
from .codec_service import CodecService
from .drain import SHUTTING_DOWN, Drain
from .requests import BYTES_INPUTS, SCALAR_INPUTS, STRING_INPUTS, request_parser
from .runtime import SMPartition, ensure_checkpoint, mps_active, resolve_device, resolve_dtype
from .sequences import TextSequences
from .settings import CodecSettings, TTSSettings, lane_sms, voices_dir
from .state_pool import CodecStatePool, PrimedStates, attach
from .triton_metrics import CodecModelMetrics, TritonMetrics
from .tts_service import TTSService, codec_slots
from .voices import EncodingQueue, VoiceEncoder, VoiceStore

log = logging.getLogger("voxtriton")
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# Triton's request flags (TRITONSERVER_RequestFlag): a sequence's first and last request.
SEQUENCE_START, SEQUENCE_END = 1, 2
WARMUP_REQUEST_ID = "voxtriton-warmup"  # the codec calls of the warm-up: test faults skip them
WARMUP_TIMEOUT_S = 300.0


def to_triton(name: str, tensor: torch.Tensor):
    # An empty tensor can carry zero strides (numpy gives them; `contiguous()` keeps them), which
    # Triton's DLPack import refuses as not contiguous: it goes as a fresh one.
    if tensor.numel() == 0:
        tensor = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
    return pb_utils.Tensor.from_dlpack(name, tensor.contiguous())


def from_triton(tensor) -> torch.Tensor:
    return torch.from_dlpack(tensor.to_dlpack()).clone()


def _exit_with_server() -> None:
    """Die with tritonserver. A stub of Triton 2.51 can outlive a killed server (blocked with the GIL
    held, so no Python thread of ours could notice), so a tiny shell process watches both pids."""
    server, stub = os.getppid(), os.getpid()
    subprocess.Popen(
        [
            "sh",
            "-c",
            f"while kill -0 {server} && kill -0 {stub}; do sleep 1; done 2>/dev/null; "
            f"kill -9 {stub} 2>/dev/null",
        ],
        start_new_session=True,
    )


def _configure_logging() -> None:
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s voxtriton %(levelname)s %(name)s: %(message)s"))
        for name in ("voxtriton",):
            logging.getLogger(name).addHandler(handler)
            logging.getLogger(name).setLevel(logging.INFO)


class TritonSink:
    """Streams one request's chunks through its decoupled response sender.

    Once the final response is sent Triton may release the request, so `cancelled()` must not ask
    about it any more, and nothing more may be sent: a flag, set under the sink's own lock, closes
    the sink first.
    """

    def __init__(self, request, sender, requested: set[str]):
        self.request, self.sender = request, sender
        self.want_codes, self.want_info = "codes" in requested, "chunk_info" in requested
        self.lock, self.closed = threading.Lock(), False

    def send(self, audio, codes, info, final):
        tensors = [to_triton("audio", audio)]
        if self.want_codes:
            tensors.append(to_triton("codes", torch.from_numpy(np.ascontiguousarray(codes, dtype=np.int32))))
        if self.want_info:
            tensors.append(to_triton("chunk_info", torch.from_numpy(info)))
        self._send(pb_utils.InferenceResponse(output_tensors=tensors), final)

    def fail(self, message):
        self._send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), True)

    def _send(self, response, final):
        with self.lock:
            if self.closed:  # a chunk decoded for a stream that was failed or cancelled meanwhile
                return
            self.sender.send(response, flags=FINAL if final else 0)
            self.closed = final  # not before: a final response that failed to go leaves room for the error

    def cancelled(self):
        with self.lock:
            return not self.closed and self.request.is_cancelled()


class BLSCodecLane:
    """A codec lane is another Triton model, called through BLS. A call carries the chunks' codes and
    their rows of the codec state pool (plus the pool's handle); the audio comes back on the CPU."""

    def __init__(self, model_name: str, pool: CodecStatePool):
        self.model_name = model_name
        self.pool_handle = pool.handle_tensor()
        # With several lane workers, the calls in flight when the process died all fail: only the
        # first of them reloads the model.
        self.restart_lock = threading.Lock()
        self.restarts = 0
        self.warming = False  # calls are the warm-up's

    def decode(self, codes, start, slots, prime=False):
        restarts_before = self.restarts
        inputs = [
            to_triton("codes", codes),
            to_triton("start", start),
            to_triton("slots", slots),
            to_triton("state_pool", self.pool_handle),
        ]
        if prime:
            inputs.append(pb_utils.Tensor("prime", np.array([True])))
        request = pb_utils.InferenceRequest(
            request_id=WARMUP_REQUEST_ID if self.warming else "",
            model_name=self.model_name,
            requested_output_names=["audio"],
            inputs=inputs,
            preferred_memory=pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0),
        )
        response = request.exec()
        if response.has_error():
            message = response.error().message()
            if "is not healthy" in message:
                self._restart(restarts_before)
            raise RuntimeError(f"{self.model_name}: {message}")
        return from_triton(pb_utils.get_output_tensor_by_name(response, "audio"))

    def _restart(self, restarts_before: int) -> None:
        """The lane's process died, and Triton 2.51 does not restart Python stubs: reload the model,
        unless another call reloaded it since this one started.

        Needs tritonserver in explicit model-control mode (`voxtriton serve` starts it so). The
        requests of the failed call still fail; the next ones go to the new process.
        """
        with self.restart_lock:
            if self.restarts != restarts_before:
                return
            self.restarts += 1
            log.error("%s: its process is gone; reloading the model", self.model_name)
            try:
                pb_utils.unload_model(self.model_name)
                pb_utils.load_model(self.model_name)
                log.info("%s: reloaded", self.model_name)
            except Exception as error:
                log.error(
                    "%s: reload failed (%s); start tritonserver with --model-control-mode=explicit "
                    "so voxtriton can restart a failed codec lane",
                    self.model_name,
                    error,
                )


class TTSTritonModel:
    def __init__(self, args: dict):
        _configure_logging()
        _exit_with_server()
        settings, scheduler_config = TTSSettings.from_model_config(args["model_config"])
        self.settings = settings
        sys.setswitchinterval(settings.switch_interval_ms / 1e3)
        device = resolve_device(settings.device)
        dtype = resolve_dtype(settings.dtype, device)
        checkpoint = ensure_checkpoint(settings.checkpoint_dir)
        family = load_family(checkpoint)
        settings.check_model(family.max_positions)
        self.family, config = family, family.config
        # The chunk scheduler's clock is the family's frames.
        scheduler_config = dataclasses.replace(
            scheduler_config.for_device(device.type), frame_seconds=family.frame_seconds
        )
        log.info(
            "tts: checkpoint %s (%s %s), device %s %s, policy %s, GIL switch interval %g ms",
            checkpoint,
            family.name,
            getattr(config, "model_type", ""),
            device,
            dtype,
            scheduler_config.policy,
            settings.switch_interval_ms,
        )
        if device.type == "cuda" and not mps_active():
            log.warning(
                "CUDA MPS is not active: the codec lanes and the backbone will time-slice the GPU "
                "instead of running side by side (start it with `voxtriton serve`)"
            )
        backbone_sms, shared = 0, False
        if device.type == "cuda" and scheduler_config.rules.background_partition:
            total = torch.cuda.get_device_properties(device).multi_processor_count
            background_sms = lane_sms(settings.background_sms, total)
            if not 0 < background_sms < total:
                raise ValueError(
                    f"config.pbtxt parameter 'background_sms' must be between 1 and {total - 1} "
                    f"(this GPU has {total} SMs), got {settings.background_sms}"
                    + (f" ({background_sms} SMs)" if settings.background_sms != str(background_sms) else "")
                )
            shared = settings.backbone_partition == "shared"
            backbone_sms = 0 if shared else total - background_sms
        self.partition = SMPartition(device, backbone_sms, high_priority=shared)
        backbone = family.load_backbone(device=device, dtype=dtype)
        if settings.fp8_weights != "off":
            if family.quantize_fp8 is None:
                raise ValueError(f"fp8_weights: FP8 weights are for Qwen3-TTS checkpoints, not {family.name}")
            projections = family.quantize_fp8(backbone, settings.fp8_weights)
            log.info("tts: FP8 weights for %d projections (%s)", projections, settings.fp8_weights)
        self.voice_encoder = self.encoding = self.voices = None
        if family.clones_voices:
            # The encoders run on the engine's device, on a thread and a CUDA stream of their own.
            graphs = device.type == "cuda" and settings.cuda_graphs
            self.voice_encoder = VoiceEncoder(family, device, graphs=graphs)
            if graphs:
                log.info("tts: reference encoder CUDA graphs: %d", self.voice_encoder.graph_count())
            self.encoding = EncodingQueue(
                self.voice_encoder,
                cache_size=settings.reference_cache,
                max_waiting=settings.max_streams + settings.max_queued,  # as many as the engine takes
            )
            self.voices = VoiceStore(voices_dir(settings.voices_dir), family, settings.max_voices)
            log.info("tts: voice cloning on, registered voices in %s", self.voices.directory)
        self.parser = request_parser(family, settings, self.voices)
        fp8_kv = fp8_kv_runner_options(family, settings.fp8_kv_cache)
        runner = family.new_runner(
            backbone,
            settings.max_streams,
            settings.max_positions,
            settings.max_text_tokens,
            prefill_stream=self.partition.new_stream() if settings.prefill_overlap else None,
            **fp8_kv,
        )
        if fp8_kv:
            log.info("tts: FP8 KV cache (%s)", settings.fp8_kv_cache)
        overlap = settings.engine_overlap and scheduler_config.rules.engine_overlap
        # A stream that starts with a 1-frame chunk gets its frame before the talker advances.
        early = settings.early_first_frames and overlap
        first_frame_rows = scheduler_config.single_frame_start_streams if early else 0
        if device.type == "cuda" and settings.cuda_graphs:
            with self.partition:  # captured on the backbone's partition stream, replayed there
                runner.capture_graphs(**settings.graph_buckets(), first_frame_rows=first_frame_rows)
            log.info("tts: captured CUDA graphs: %s", runner.graph_counts())
        state_size = family.codec_state_size()
        engine = Engine(
            runner,
            settings.max_streams,
            overlap=overlap,
            text_lookahead=settings.text_lookahead,
            first_frame_rows=first_frame_rows,
        )
        # Published for the codec processes of this tritonserver (the parent of every model's stub).
        slots = codec_slots(
            engine, settings.max_queued, scheduler_config, settings.lane_workers, settings.max_draining
        )
        self.state_pool = CodecStatePool(slots, state_size, device, publish_for=os.getppid())
        log.info(
            "tts: codec state pool of %d streams (%.0f MB)",
            self.state_pool.rows,
            self.state_pool.rows * state_size * 4 / 1e6,
        )
        self.lanes = {
            URGENT: BLSCodecLane(settings.codec_urgent_model, self.state_pool),
            BACKGROUND: BLSCodecLane(settings.codec_background_model, self.state_pool),
        }
        self.metrics = TritonMetrics()
        self.chunk_trace = (
            open(settings.chunk_trace_path, "a", buffering=1 << 20) if settings.chunk_trace_path else None
        )
        self.service = TTSService(
            engine,
            scheduler_config,
            self.lanes,
            settings.max_queued,
            settings.cancellation_check_s,
            metrics=self.metrics,
            device=device,
            engine_context=self.partition,
            chunk_trace=self.chunk_trace,
            lane_workers=settings.lane_workers,
            max_draining=settings.max_draining,
            cancellation_lock_share=settings.cancellation_lock_share,
            primed_states=(
                PrimedStates(self.state_pool.tensor, settings.primed_voices)
                if self.voices is not None
                else None
            ),
        )
        self.sequences = TextSequences(
            self.parser,
            self.service,
            settings.text_idle_timeout_s,
            clock=self.service.clock,
            max_open_s=settings.text_stream_max_s,
        )
        self.drain = Drain(settings.drain_file, self._idle)
        self.ids = itertools.count()
        self.loading = True  # until Triton's warm-up sample (model_warmup in config.pbtxt) was answered

    def execute(self, requests):
        if self.loading:
            self.loading = False
            if all(_is_warmup_sample(request) for request in requests):
                if self.settings.warmup:
                    self._warm_up()
                # An error response to a warm-up sample hangs the model's load (Triton 2.51).
                for request in requests:
                    request.get_response_sender().send(flags=FINAL)
                return None
        with self.drain.execute() as draining:
            self._take(requests, draining)
        return None

    def _take(self, requests, draining: bool) -> None:
        for request in requests:
            sender = request.get_response_sender()
            request_id = f"{request.request_id() or 'request'}#{next(self.ids)}"
            try:
                if draining and not _continues_a_sequence(request):
                    raise ServerBusy(SHUTTING_DOWN)
                inputs = {}
                for name in STRING_INPUTS + BYTES_INPUTS + tuple(SCALAR_INPUTS):
                    tensor = pb_utils.get_input_tensor_by_name(request, name)
                    if tensor is not None:
                        inputs[name] = tensor.as_numpy()
                sequence_id = request.correlation_id()
                if sequence_id not in (0, ""):  # a piece of an input stream (no sequence batcher: see docs)
                    # A string id is quoted: sequence "201" is not sequence 201.
                    key = str(sequence_id) if isinstance(sequence_id, int) else repr(sequence_id)
                    self._piece(request, sender, key, request_id, inputs)
                    continue
                sink = TritonSink(request, sender, set(request.requested_output_names()))
                reference = self.parser.reference(inputs)
                if reference is None:
                    self.service.submit(self.parser.parse(request_id, inputs), sink)
                else:  # the encoder thread submits it once its voice is encoded
                    self._submit_with_voice(request_id, inputs, sink, *reference)
            except (RequestError, ServerBusy) as error:
                _refuse(sender, str(error))
            except Exception as error:  # never leave a stream without its final response
                log.exception("tts: request %s failed before generation", request_id)
                _refuse(sender, f"internal error: {error}")

    def _submit_with_voice(self, request_id, inputs, sink, audio: bytes, text: str | None) -> None:
        arrived = self.service.clock()  # its TTFA and first chunk's due time count the encoding too

        def submit(voice):
            self.metrics.reference_encoded(self.service.clock() - arrived)
            self.service.submit(self.parser.parse(request_id, inputs, voice), sink, opened_at=arrived)

        self.encoding.submit(audio, text, submit, sink.fail)

    def _piece(self, request, sender, sequence_id: str, request_id: str, inputs: dict) -> None:
        """One text piece of an input stream. The first piece's sender carries the audio, its final
        response with the last chunk; a later piece gets an empty final response once its text is
        taken (or its error)."""
        flags = request.flags()
        start = bool(flags & SEQUENCE_START)
        self.sequences.piece(
            sequence_id,
            start,
            bool(flags & SEQUENCE_END),
            inputs,
            request_id,
            lambda: TritonSink(request, sender, set(request.requested_output_names())),
        )
        if not start:
            sender.send(flags=FINAL)

    def _warm_up(self) -> None:
        """One request per lane the policy uses, through the engine, the scheduler and BLS to the codec
        models, before Triton marks this model ready. BLS works only once the server is up: in
        initialize() Triton 2.51 refuses it, and while the server starts it answers "Server not
        ready"; so this runs in the warm-up sample's execute, of a model loaded after the codec
        models and after the server started (`voxtriton serve` loads it so)."""
        config = self.service.scheduler.config
        frames = min(sum(config.sizes), self.settings.max_frames)  # one chunk of each size
        inputs = {
            "text": np.array([b"Warming up every lane."], dtype=object),
            "max_frames": np.array([frames], np.int32),
            "ignore_eos": np.array([True]),
            "seed": np.array([0], np.int64),
        }
        started = time.perf_counter()
        for lane in self.lanes.values():
            lane.warming = True
        try:
            voice = None
            if self.voice_encoder is not None:  # an in-context voice: the encoders and codec priming too
                tone = np.sin(np.arange(24000) * (2 * np.pi * 220 / 24000)).astype(np.float32) * 0.3
                voice = self.voice_encoder.encode([tone], ["Warming up."])[0]
            requests = {lane: self.parser.parse(f"warmup-{lane}", inputs, voice) for lane in config.lanes}
            self.service.warm_up(requests, WARMUP_TIMEOUT_S)
            primed = self._prime_registered_voices(inputs, config.lanes)
            log.info(
                "tts: warmed up in %.2f s (%d frames on each of the lanes %s; %d registered voices primed)",
                time.perf_counter() - started,
                frames,
                ", ".join(config.lanes),
                primed,
            )
        except Exception as error:
            log.error(
                "tts: warm-up failed (%s); serving anyway, the first requests pay for the cold start. "
                "Load this model after the server has started (voxtriton serve does)",
                error,
            )
        finally:
            for lane in self.lanes.values():
                lane.warming = False

    def _prime_registered_voices(self, inputs: dict, lanes: tuple[str, ...]) -> int:
        """One frame on every lane for each registered in-context voice, the newest first, as many as
        `primed_voices` keeps on every lane: their codec states are primed before ready, so a voice's
        first stream after a restart starts from a kept state too. Returns how many were primed."""
        kept = self.service.primed_states
        if self.voices is None or kept is None:
            return 0
        inputs = {**inputs, "max_frames": np.array([1], np.int32)}
        primed = 0
        for name in self.voices.newest():
            if primed == kept.capacity // len(lanes):
                break
            try:  # a voice that cannot be primed is primed at its first stream, as before
                voice = self.voices.get(name)
                if voice is None:  # deleted meanwhile
                    continue
                requests = {lane: self.parser.parse(f"prime-{lane}", inputs, voice) for lane in lanes}
                if requests[lanes[0]].prompt.reference_codes is None:  # nothing to prime (x-vector, CSM)
                    continue
                self.service.warm_up(requests, WARMUP_TIMEOUT_S)
            except (RequestError, RuntimeError, TimeoutError) as error:
                log.warning("tts: registered voice %r not primed: %s", name, error)
                continue
            primed += 1
        return primed

    def _idle(self) -> bool:
        """Nothing in flight: no open input stream, no request waiting for its voice, no stream. In
        this order, upstream first: each hands its work downstream before it lets go of it."""
        return (
            self.sequences.idle() and (self.encoding is None or self.encoding.idle()) and self.service.idle()
        )

    def finalize(self):
        try:
            self.drain.shutdown()
            self.sequences.shutdown()
            if self.encoding is not None:
                self.encoding.shutdown()
            self.service.shutdown()
        finally:  # the metrics writer must not call into Triton after this
            self.metrics.close()
            self.state_pool.close()
            if self.chunk_trace:
                self.chunk_trace.close()


def _refuse(sender, message: str) -> None:
    """A request's final response, an error. One whose final response went already (its stream
    failed meanwhile) makes Triton raise: logged, so the batch's other requests are still answered."""
    try:
        sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), flags=FINAL)
    except Exception as error:
        log.warning("tts: could not send the error %r: %s", message, error)


def _continues_a_sequence(request) -> bool:
    """A later piece of an input stream (one that may be open: its text is still taken)."""
    return request.correlation_id() not in (0, "") and not request.flags() & SEQUENCE_START


def _is_warmup_sample(request) -> bool:
    """Triton's warm-up sample (config.pbtxt) has an empty text, which no client's request may have."""
    text = pb_utils.get_input_tensor_by_name(request, "text")
    return text is not None and text.as_numpy().size == 1 and text.as_numpy().reshape(-1)[0] in (b"", "")


class CodecTritonModel:
    def __init__(self, args: dict):
        _configure_logging()
        _exit_with_server()
        self.name = json.loads(args["model_config"])["name"]
        self.service = CodecService(CodecSettings.from_model_config(args["model_config"]), self.name)
        self.metrics = CodecModelMetrics(self.name)
        log.info(
            "%s: device %s, %s SMs, state size %d",
            self.name,
            self.service.device,
            self.service.partition.sm_count or "all",
            self.service.state_size,
        )

    def execute(self, requests):
        responses = []
        for request in requests:
            started = time.perf_counter()
            try:

                def get(name):
                    return from_triton(pb_utils.get_input_tensor_by_name(request, name))

                pool = attach(get("state_pool").cpu().numpy().tobytes(), server_pid=os.getppid())
                warmup = request.request_id() == WARMUP_REQUEST_ID
                prime = pb_utils.get_input_tensor_by_name(request, "prime")
                prime = prime is not None and bool(prime.as_numpy()[0])
                codes, start, slots = get("codes"), get("start"), get("slots")
                decode_started = time.perf_counter()
                audio = self.service.decode(codes, start, slots, pool, warmup=warmup, prime=prime)
                decode_s = time.perf_counter() - decode_started
                responses.append(pb_utils.InferenceResponse(output_tensors=[to_triton("audio", audio)]))
                self.metrics.call(time.perf_counter() - started, decode_s)
            except Exception as error:
                log.error("%s: decode failed: %s", self.name, error)
                # The calling lane names this model in the error it reports.
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error))))
        return responses

    def finalize(self):
        self.metrics.close()

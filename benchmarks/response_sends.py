"""What does a codec lane pay to send a batch of chunks, and the cancellation watcher to check
streams? A real tritonserver runs one throwaway decoupled Python model. The client opens one
streaming request per chunk of a batch, as a codec call decodes one chunk for each of several
streams; the model then sends batches of responses (one chunk of audio to each request), as a lane
worker does after a codec call, or checks each request for cancellation, as the watcher does in a
hold of the service lock (a few of them: a hold lasts about `MAX_HOLD_S`, 1 ms), and times one batch:
- alone, or beside a thread that runs Python (as the engine thread does, handling every frame
  step's frames);
- one send after the other (each a round trip to the server process that drops the GIL, and beside
  a thread running Python takes about the switch interval to get it back; `bls_gil.py`), or every
  send of the batch on a thread of its own at once, or one cancellation check after the other
  (`is_cancelled()`, also a round trip that drops the GIL);
- at several switch intervals (the interpreter's default is 5 ms), with what the thread running
  Python gives up meanwhile (its speed as a share of its speed alone).

    python benchmarks/response_sends.py --chunks 6 --batches 50 --switch-intervals-ms 5,0.5,0.1
    python benchmarks/response_sends.py --chunks 32 --batches 20   # 32 checks: several of the watcher's holds
"""

from __future__ import annotations

import argparse
import queue
import tempfile
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from voxtriton.serving.launcher import TritonServer

CONFIG = """name: "sender"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "SHAPE" data_type: TYPE_INT32 dims: [ 3 ] } ]
output [ { name: "AUDIO" data_type: TYPE_FP32 dims: [ -1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

SENDER = """import sys, threading, time
from concurrent.futures import ThreadPoolExecutor
import numpy as np
import triton_python_backend_utils as pb_utils

CASES = {cases!r}
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class Spinner:  # a thread that runs Python, counting its loops
    def __enter__(self):
        self.stop, self.loops = threading.Event(), 0
        self.thread = threading.Thread(target=self.spin)
        self.thread.start()
        time.sleep(0.05)
        self.restart()
        return self

    def restart(self):  # count from now on
        self.started, self.first = time.perf_counter(), self.loops

    def spin(self):
        while not self.stop.is_set():
            self.loops += 1

    def rate(self):
        return (self.loops - self.first) / (time.perf_counter() - self.started)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def timed(send_batch, batches, beside_python, switch_interval_s):
    # ms per batch, and the spinner's speed meanwhile as a share of its speed while this thread sleeps
    default = sys.getswitchinterval()
    sys.setswitchinterval(switch_interval_s)
    try:
        if not beside_python:
            started = time.perf_counter()
            for _ in range(batches):
                send_batch()
            return (time.perf_counter() - started) / batches * 1e3, 0.0
        with Spinner() as spinner:
            time.sleep(0.3)
            alone = spinner.rate()
            spinner.restart()
            for _ in range(batches):
                send_batch()
            ms = (time.perf_counter() - spinner.started) / batches * 1e3
            return ms, spinner.rate() / alone
    finally:
        sys.setswitchinterval(default)


class TritonPythonModel:
    def initialize(self, args):
        self.senders = []

    def execute(self, requests):
        for request in requests:
            shape = pb_utils.get_input_tensor_by_name(request, "SHAPE").as_numpy()
            chunks, batches, samples = (int(v) for v in shape)
            self.senders.append(request.get_response_sender())
        if len(self.senders) == chunks:  # every stream of the batch is open: measure, off Triton's thread
            threading.Thread(target=self.measure, args=(self.senders, batches, samples)).start()
            self.senders = []
        return None

    def measure(self, senders, batches, samples):
        audio = np.random.rand(samples).astype(np.float32)
        pool = ThreadPoolExecutor(len(senders))
        send = lambda sender: sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("AUDIO", audio)]))
        def one_after_another():
            for sender in senders:
                send(sender)
        def all_at_once():
            list(pool.map(send, senders))
        def cancellation_checks():
            for sender in senders:
                sender.is_cancelled()
        batch_of = {"one after another": one_after_another, "all at once": all_at_once,
                    "cancellation checks": cancellation_checks}
        times = []
        for interval, beside, mode in CASES:
            times += timed(batch_of[mode], batches, beside, interval)
        pool.shutdown()
        # The first stream's last response: per case, in the order of CASES, ms per batch and the
        # spinner's speed as a share of its speed alone.
        times = pb_utils.Tensor("AUDIO", np.array(times, np.float32))
        senders[0].send(pb_utils.InferenceResponse([times]), flags=FINAL)
        for sender in senders[1:]:
            sender.send(flags=FINAL)
"""


def write_repository(root: Path, cases: list[tuple]) -> Path:
    """`cases`: (switch interval in seconds, beside a thread running Python, how a batch is sent)."""
    (root / "sender" / "1").mkdir(parents=True)
    (root / "sender" / "config.pbtxt").write_text(CONFIG)
    (root / "sender" / "1" / "model.py").write_text(SENDER.replace("{cases!r}", repr(cases)))
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=6, help="chunks (streams) per batch: an urgent call's")
    parser.add_argument("--batches", type=int, default=50, help="batches timed per case")
    parser.add_argument("--frames", type=int, default=4, help="audio frames per chunk (1920 samples each)")
    parser.add_argument("--switch-intervals-ms", default="5,0.5", help="comma-separated")
    parser.add_argument("--tritonserver", help="tritonserver binary (default: as `voxtriton serve` finds it)")
    args = parser.parse_args()
    cases = [
        (float(ms) / 1e3, beside, mode)
        for ms in args.switch_intervals_ms.split(",")
        for beside in (False, True)
        for mode in ("one after another", "all at once", "cancellation checks")
    ]
    with tempfile.TemporaryDirectory() as tmp:
        server = TritonServer(
            repository=write_repository(Path(tmp), cases), tritonserver=args.tritonserver, use_mps=False
        )
        with server:
            client = grpcclient.InferenceServerClient(server.grpc_url)
            results: queue.Queue = queue.Queue()
            client.start_stream(callback=lambda result, error: results.put((result, error)))
            shape = grpcclient.InferInput("SHAPE", [3], "INT32")
            shape.set_data_from_numpy(np.array([args.chunks, args.batches, args.frames * 1920], np.int32))
            for stream in range(args.chunks):
                client.async_stream_infer(
                    "sender", [shape], request_id=str(stream), enable_empty_final_response=True
                )
            times, open_streams = None, args.chunks
            while open_streams:
                result, error = results.get(timeout=600)
                if error is not None:
                    raise SystemExit(f"sender failed: {error}\n{server.log_tail(20)}")
                response = result.get_response()
                if response.parameters["triton_final_response"].bool_param:
                    open_streams -= 1
                    if response.id == "0":
                        times = result.as_numpy("AUDIO")
            client.stop_stream()
    print(
        f"one batch of {args.chunks} chunk sends to {args.chunks} streams "
        f"({args.frames} frames of audio each), "
        f"or of {args.chunks} cancellation checks, mean of {args.batches} batches, ms:"
    )
    for (interval, beside, mode), ms, share in zip(cases, times[0::2], times[1::2]):
        print(
            f"  {mode}, {'beside a thread running Python' if beside else 'alone'}, switch interval "
            f"{interval * 1e3:g} ms: {ms:.2f}"
            + (f" (that thread ran at {share:.0%} of its speed alone)" if beside else "")
        )


if __name__ == "__main__":
    main()

"""Does a BLS call hold the GIL while it waits? A real tritonserver runs two throwaway Python models:
`caller` spins a counter thread while its main thread (a) sleeps, (b) waits on a BLS call to
`sleeper` (which sleeps in its own process), (c) spins itself. Full counter speed during (b), like
(a), means the wait releases the GIL; half speed, like (c), would mean it holds it.

Then the price of releasing it: `caller` times a custom-metric update and a request-cancellation
check (round trips to the server process, which release the GIL) alone and beside the spinning
thread. Beside it, each waits for the GIL for about the interpreter's switch interval (5 ms): why
voxtriton keeps metric updates off its engine thread (serving/triton_metrics.py) and sweeps
cancellation checks under its service lock (serving/tts_service.py).

    python benchmarks/bls_gil.py --seconds 0.5
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from voxtriton.serving.launcher import TritonServer

CONFIG = """name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "{output}" data_type: TYPE_FP32 dims: [ {dims} ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
"""

SLEEPER = """import time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            time.sleep(float(x[0]))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
        return responses
"""

CALLER = """import threading, time
import numpy as np
import triton_python_backend_utils as pb_utils

def counter_rate(action):
    stop, count = threading.Event(), [0]
    def spin():
        while not stop.is_set():
            count[0] += 1
    thread = threading.Thread(target=spin)
    thread.start()
    time.sleep(0.05)
    first, started = count[0], time.perf_counter()
    action()
    rate = (count[0] - first) / (time.perf_counter() - started)
    stop.set()
    thread.join()
    return rate

def round_trip_seconds(call, spinning, calls=200):  # mean seconds of one call(), alone or beside a spinner
    stop = threading.Event()
    def spin():
        while not stop.is_set():
            pass
    thread = threading.Thread(target=spin)
    if spinning:
        thread.start()
        time.sleep(0.05)
    started = time.perf_counter()
    for _ in range(calls):
        call()
    seconds = (time.perf_counter() - started) / calls
    stop.set()
    if spinning:
        thread.join()
    return seconds

class TritonPythonModel:
    def initialize(self, args):
        self.family = pb_utils.MetricFamily(name="probe_seconds", description="probe",
                                            kind=pb_utils.MetricFamily.HISTOGRAM)
        self.metric = self.family.Metric(labels={}, buckets=[0.1])

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            seconds = float(x[0])
            def bls():
                response = pb_utils.InferenceRequest(model_name="sleeper", requested_output_names=["Y"],
                                                     inputs=[pb_utils.Tensor("X", x)]).exec()
                assert not response.has_error()
            def spin():
                end = time.perf_counter() + seconds
                while time.perf_counter() < end:
                    pass
            def check_cancellation():
                end = time.perf_counter() + seconds
                while time.perf_counter() < end:
                    request.is_cancelled()
            update = lambda: self.metric.observe(0.01)
            rates = [counter_rate(lambda: time.sleep(seconds)), counter_rate(bls), counter_rate(spin),
                     counter_rate(check_cancellation),
                     round_trip_seconds(update, False), round_trip_seconds(update, True),
                     round_trip_seconds(request.is_cancelled, False),
                     round_trip_seconds(request.is_cancelled, True)]
            rates = pb_utils.Tensor("RATES", np.array(rates, np.float32))
            responses.append(pb_utils.InferenceResponse([rates]))
        return responses
"""


def write_repository(root: Path) -> Path:
    for name, output, dims, code in (("sleeper", "Y", 1, SLEEPER), ("caller", "RATES", 8, CALLER)):
        (root / name / "1").mkdir(parents=True)
        (root / name / "config.pbtxt").write_text(CONFIG.format(name=name, output=output, dims=dims))
        (root / name / "1" / "model.py").write_text(code)
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--tritonserver", help="tritonserver binary (default: as `voxtriton serve` finds it)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = TritonServer(
            repository=write_repository(Path(tmp)), tritonserver=args.tritonserver, use_mps=False
        )
        with server:
            client = grpcclient.InferenceServerClient(server.grpc_url)
            x = grpcclient.InferInput("X", [1], "FP32")
            x.set_data_from_numpy(np.array([args.seconds], np.float32))
            for _ in range(args.repeat):
                (
                    sleeping,
                    waiting,
                    spinning,
                    checking,
                    update_alone,
                    update_beside,
                    check_alone,
                    check_beside,
                ) = client.infer("caller", [x]).as_numpy("RATES")
                print(
                    f"counter thread, iterations/s: beside a sleep {sleeping:.3g}, beside a BLS wait "
                    f"{waiting:.3g}, beside a spinning thread {spinning:.3g}, beside a loop of cancellation "
                    f"checks {checking:.3g}; one metric update: {update_alone * 1e3:.3f} ms alone, "
                    f"{update_beside * 1e3:.2f} ms beside a spinning thread; one cancellation check: "
                    f"{check_alone * 1e3:.3f} ms alone, {check_beside * 1e3:.2f} ms beside a spinning thread"
                )


if __name__ == "__main__":
    main()

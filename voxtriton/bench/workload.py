"""The load: utterances of random length sent as streaming requests, in open or closed loop, to a
target (voxtriton over gRPC or an OpenAI-compatible endpoint: voxtriton.bench.targets)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import multiprocessing
import os
import random
import sys
import time
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass

from voxtriton.bench.summary import RequestResult
from voxtriton.bench.targets import FRAME_RATE, Utterance

TEXTS = [
    "Good morning, and welcome to the show.",
    "The weather today will be mostly sunny with a light breeze.",
    "Please hold while I connect you to the next available agent.",
    "Your order has shipped and should arrive soon.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman.",
    "Turn left at the next intersection, then continue straight for two kilometres.",
    "The meeting has been moved to Thursday afternoon at three o'clock.",
    "Streaming speech should start fast and never stall, even under heavy load.",
]
# A stream with no final response by then counts as failed (with that error), so a server that stops
# answering ends a probe instead of hanging it (a 20 s utterance takes about 12 s near the goodput).
REQUEST_TIMEOUT_S = 180.0


class Progress:
    """A bar redrawn in place on a terminal; into a log file (no terminal), one line per tenth."""

    def __init__(self, label: str, total: float):
        self.label, self.total, self.started = label, total, time.monotonic()
        self.redraw, self.tenths_shown = sys.stderr.isatty(), -1

    def update(self, done: float, note: str = "") -> None:
        width = 30
        fraction = min(1.0, done / self.total) if self.total else 1.0
        filled = int(width * fraction)
        bar = f"{self.label} [{'#' * filled}{'.' * (width - filled)}]"
        if self.redraw:
            sys.stderr.write(f"\r{bar} {note:<40}")
        elif int(fraction * 10) > self.tenths_shown:
            self.tenths_shown = int(fraction * 10)
            sys.stderr.write(f"{bar} {note}\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.redraw:
            sys.stderr.write("\n")


@dataclass(frozen=True)
class VoiceMix:
    """Each request's voice: one of `shares` ((voice, probability), in all at most 1), else `default`."""

    default: str | None
    shares: tuple[tuple[str, float], ...]

    @classmethod
    def parse(cls, default: str | None, text: str) -> VoiceMix:
        """ "anna:0.3,bob:0.2" -> anna for 30% of requests, bob for 20%, `default` for the rest;
        ValueError saying what is wrong."""
        shares = []
        for item in text.split(","):
            name, _, share = item.partition(":")
            try:
                value = float(share)
            except ValueError:
                raise ValueError(f"--voice-mix: {item!r} is not VOICE:SHARE (a share from 0 to 1)") from None
            if not name or not 0 < value <= 1:
                raise ValueError(f"--voice-mix: {item!r} is not VOICE:SHARE (a share from 0 to 1)")
            shares.append((name, value))
        if sum(share for _, share in shares) > 1 + 1e-9:
            raise ValueError(f"--voice-mix: the shares of {text!r} add up to more than 1")
        return cls(default, tuple(shares))

    def pick(self, rng: random.Random) -> str | None:
        draw = rng.random()
        for name, share in self.shares:
            if draw < share:
                return name
            draw -= share
        return self.default


def draw_utterance(rng: random.Random, seconds_range) -> Utterance:
    """A text of TEXTS, a length of U(seconds_range) seconds in whole frames, and a sampling seed."""
    seconds = rng.uniform(*seconds_range)
    frames = max(1, round(seconds * FRAME_RATE))
    return Utterance(rng.choice(TEXTS), frames, rng.randrange(2**31))


async def one_request(
    target,
    rng: random.Random,
    seconds_range,
    speaker: str | VoiceMix | None,
    timeout: float = REQUEST_TIMEOUT_S,
    sent: float | None = None,
) -> RequestResult:
    """`sent`: when the request was due (an open loop's arrival time; now by default). Its times count
    from then, so a client that falls behind its arrivals adds its delay, not hides it."""
    utterance = draw_utterance(rng, seconds_range)
    if isinstance(speaker, VoiceMix):  # drawn after the utterance, which stays what it is without a mix
        speaker = speaker.pick(rng)
    sent = time.perf_counter() if sent is None else sent
    try:
        return await asyncio.wait_for(target.request(utterance, speaker, sent), timeout)
    except asyncio.TimeoutError:
        error = f"no final response within {timeout:g} s"
    except Exception as failure:  # connection-level failures count as failed requests
        error = repr(failure)
    return RequestResult(sent, None, 0.0, 0.0, None, error, asked_s=utterance.seconds)


async def loop_lag(samples: list[float], stop: asyncio.Event, interval: float = 0.01) -> None:
    """How late the event loop wakes up: if this grows, the client, not the server, is the bottleneck."""
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(interval)
        samples.append(time.perf_counter() - start - interval)


def arrivals(rate: float, duration: float, burstiness: float, seed: int | str, first_at_start: bool = True):
    """An open loop's requests: (seconds from its start, the request's own random generator), with
    gaps from a Gamma distribution of mean 1/rate and shape 1/burstiness**2, for `duration` seconds.
    The first arrives at the start, or one gap after it where `first_at_start` is False (the shards
    of one open loop but the first: K shards would otherwise send K requests at once)."""
    rng = random.Random(seed)
    shape = 1.0 / burstiness**2

    def gap() -> float:
        return rng.gammavariate(shape, 1.0 / (rate * shape))

    at = 0.0 if first_at_start else gap()
    while at < duration:
        yield at, random.Random(rng.random())
        at += gap()


async def open_loop(
    make_target: Callable,
    rate: float,
    duration: float,
    burstiness: float,
    seconds_range,
    seed: int | str,
    speaker: str | VoiceMix | None,
    progress: Progress | None = None,
    start_at: float | None = None,
    first_at_start: bool = True,
) -> tuple[list[RequestResult], list[float]]:
    """The requests of `arrivals(...)` from `start_at` (a time.perf_counter() instant; now by default)."""
    lag: list[float] = []
    stop = asyncio.Event()
    client = make_target()  # made in this event loop, which its connections belong to
    try:
        lag_task = asyncio.create_task(loop_lag(lag, stop))
        tasks = []
        start = time.perf_counter() if start_at is None else start_at
        for at, arrival in arrivals(rate, duration, burstiness, seed, first_at_start):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(
                asyncio.create_task(one_request(client, arrival, seconds_range, speaker, sent=start + at))
            )
            if progress:
                progress.update(at, f"{len(tasks)} sent")
        results = await asyncio.gather(*tasks)
        stop.set()
        await lag_task
    finally:
        await client.close()
    return list(results), lag


@contextlib.contextmanager
def without_gc():
    """No garbage collection while a probe runs: a full collection over hundreds of streams' objects
    stalls the client's event loop, which would delay chunks and show as stalls the server did not cause."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def open_loop_shard(*arguments, **keywords) -> tuple[list[RequestResult], list[float]]:
    """`open_loop(...)` in a client process of its own, as the harness runs one in its own."""
    with without_gc():
        return asyncio.run(open_loop(*arguments, **keywords))


_all_started = None  # a client process's barrier with the others of its pool


def _join(barrier) -> None:
    global _all_started
    _all_started = barrier


def _started(_: int) -> int:
    _all_started.wait(timeout=300)  # each task waits for all the others: one task per process
    return os.getpid()


@contextlib.contextmanager
def client_processes(count: int):
    """`count` client processes for `sharded_open_loop`, each started and its imports done before
    this yields them; None for one (the harness's own process). Spawned, not forked: gRPC's channels
    do not survive a fork."""
    if count == 1:
        yield None
        return
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        count, mp_context=context, initializer=_join, initargs=(context.Barrier(count),)
    ) as pool:
        pids = set(pool.map(_started, range(count)))
        assert len(pids) == count, f"{len(pids)} client processes of {count}"
        yield pool


async def sharded_open_loop(
    pool: Executor,
    processes: int,
    make_target: Callable,
    rate: float,
    duration: float,
    burstiness: float,
    seconds_range,
    seed: int,
    speaker: str | VoiceMix | None,
) -> tuple[list[RequestResult], list[float]]:
    """The open loop from `processes` client processes of `pool` at once, each with arrivals at
    `rate / processes` of its own (the sum of independent Poisson processes is one at `rate`; with
    burstiness, the merged arrivals are less bursty than one process's), and the same start (only the
    first process's first arrival at it). One Python process cannot keep up with the thousands of
    streams of several GPUs; its event-loop lag would show. Returns the requests of all, and every
    process's lag samples."""
    start_at = time.perf_counter() + 1.0  # all begin together, once the arguments have reached them
    loop = asyncio.get_running_loop()
    shards = [
        loop.run_in_executor(
            pool,
            functools.partial(open_loop_shard, start_at=start_at, first_at_start=index == 0),
            make_target,
            rate / processes,
            duration,
            burstiness,
            seconds_range,
            f"{seed}/{index}",  # a shard's own arrivals, the same in every run of this seed
            speaker,
        )
        for index in range(processes)
    ]
    results, lag = [], []
    for shard_results, shard_lag in await asyncio.gather(*shards):
        results += shard_results
        lag += shard_lag
    return results, lag


async def closed_loop(
    make_target: Callable,
    streams: int,
    duration: float,
    seconds_range,
    seed: int,
    speaker: str | VoiceMix | None,
) -> tuple[list[RequestResult], list[float]]:
    rng = random.Random(seed)
    lag: list[float] = []
    stop = asyncio.Event()
    results: list[RequestResult] = []
    client = make_target()
    try:
        lag_task = asyncio.create_task(loop_lag(lag, stop))
        end = time.perf_counter() + duration

        async def worker(index: int):
            local = random.Random(rng.random() + index)
            while time.perf_counter() < end:
                results.append(await one_request(client, local, seconds_range, speaker))

        await asyncio.gather(*(worker(i) for i in range(streams)))
        stop.set()
        await lag_task
    finally:
        await client.close()
    return results, lag

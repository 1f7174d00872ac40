"""Routing streams over N GPUs: a discrete-event simulation driven by one H200's capacity curve.

Model and its assumptions:
- Workload: Poisson arrivals at a per-GPU rate x N; each stream has U(3, 20) s of audio and holds
  its GPU for that long (generation is paced to playback, as in serving_bench's workload).
- TTFA: a request's TTFA is the measured p90 TTFA at the streams in flight on its GPU when it
  arrives, interpolated linearly between the probes of goodput_h200.json (streams = rate x mean
  audio, Little's law) and one stream's TTFA; the curve is made non-decreasing, flat past its ends.
- Stall: a GPU stalls its streams when more are in flight than the highest peak of any measured
  probe without a stall; a request that arrives to such a GPU counts as stalled.
- Start: the stationary streams in flight (M/G/inf: Poisson count, equilibrium residual lengths),
  spread evenly over the GPUs (`random`: at random), then a warm-up of arrivals before measuring.

Policies: `least_request` (one proxy, exact counts, all GPUs compared: Envoy LEAST_REQUEST with a
full scan), `p2c` (the lower of two random GPUs: Envoy's default choice_count 2), `k_proxies` (k
proxies, each request to a random one, each routing least-request on its own streams only),
`stale_metrics` (least-request on counts scraped every few seconds plus the router's own sends
since the scrape, as a gateway reading Prometheus would) and `random`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

POLICIES = ("least_request", "p2c", "k_proxies", "stale_metrics", "random")
AUDIO_S = (3.0, 20.0)
TTFA_TARGET_MS = 200.0


@dataclass(frozen=True)
class Capacity:
    """One GPU: TTFA (ms) by streams in flight, the stall level and the measured goodput (req/s)."""

    streams: np.ndarray
    ttfa_ms: np.ndarray
    stall_streams: int
    goodput: float

    def ttfa(self, streams) -> np.ndarray:
        return np.interp(streams, self.streams, self.ttfa_ms)


def read_capacity(goodput_json: Path, single_stream_json: Path, policy: str = "voxserve") -> Capacity:
    """The capacity curve of one server policy from the H200 goodput probes and one stream's TTFA."""
    data = json.loads(Path(goodput_json).read_text())
    probes = [p for p in data["probes"] if p["policy"] == policy]
    if not probes:
        raise ValueError(f"{goodput_json}: no probes of policy {policy!r}")
    by_rate: dict[float, list[tuple[float, float]]] = {}
    for p in probes:
        streams = p["rate"] * p["audio_s"] / p["requests"]
        by_rate.setdefault(p["rate"], []).append((streams, p["ttfa_p90_ms"]))
    single = json.loads(Path(single_stream_json).read_text())
    one = next(c for s in single["policies"] if s["policy"] == policy for c in s["concurrency"])
    points = [(1.0, one["ttfa_p90_ms"])] + [tuple(np.mean(v, axis=0)) for _, v in sorted(by_rate.items())]
    streams, ttfa = np.array(points).T
    if np.any(np.diff(streams) <= 0):
        raise ValueError(f"{goodput_json}: streams in flight do not grow with the rate: {streams}")
    (entry,) = [g for name, g in data["goodput"].items() if name.endswith(f" {policy}")]
    return Capacity(
        streams=streams,
        ttfa_ms=np.maximum.accumulate(ttfa),
        stall_streams=max(p["listeners_peak"] for p in probes if p["stalled"] == 0),
        goodput=float(entry["goodput"]),
    )


@dataclass(frozen=True)
class Run:
    ttfa_p90_ms: float
    ttfa_p99_ms: float
    excess_p99: float  # streams on the chosen GPU above the mean over GPUs, p99 over requests
    stalled: int
    requests: int

    @property
    def passed(self) -> bool:
        return self.ttfa_p90_ms <= TTFA_TARGET_MS and self.stalled == 0


def simulate(
    capacity: Capacity,
    policy: str,
    gpus: int,
    rate: float,
    *,
    seed: int = 0,
    warm_up_s: float = 6.0,
    measure_s: float = 10.0,
    proxies: int = 4,
    scrape_s: float = 5.0,
) -> Run:
    """One run at `rate` requests/s per GPU; TTFA and stalls of the requests after the warm-up."""
    if policy not in POLICIES:
        raise ValueError(f"policy: {policy!r} is not one of {', '.join(POLICIES)}")
    rng = np.random.default_rng(seed)
    total = rate * gpus
    # The stationary streams in flight: equilibrium residual of U(lo, hi) by inverse CDF.
    lo, hi = AUDIO_S
    start = rng.poisson(total * (lo + hi) / 2)
    residual = _equilibrium_residual(rng.random(start), lo, hi)
    arrivals = int(total * (warm_up_s + measure_s) * 1.2) + 100
    times = np.cumsum(rng.exponential(1.0 / total, arrivals))
    times = times[times < warm_up_s + measure_s]
    ends = np.concatenate([residual, times + rng.uniform(lo, hi, times.size)])
    gpu = np.empty(start + times.size, dtype=np.int64)
    gpu[:start] = rng.integers(0, gpus, start) if policy == "random" else rng.permutation(start) % gpus
    proxy = rng.integers(0, proxies, start + times.size)
    choose = _router(policy, rng, gpus, times.size, gpu[:start], proxy, scrape_s)
    order = np.argsort(ends, kind="stable").tolist()
    ends_sorted = ends[order].tolist()
    counts = np.bincount(gpu[:start], minlength=gpus)
    seen = np.zeros(times.size, dtype=np.int64)
    in_flight = np.zeros(times.size, dtype=np.int64)
    departed = 0
    gpu_list = gpu.tolist()
    for i, t in enumerate(times.tolist()):
        while ends_sorted[departed] <= t:
            j = order[departed]
            counts[gpu_list[j]] -= 1
            choose.departed(gpu_list[j], j)
            departed += 1
        g = choose(i, t, counts, start + i)
        gpu_list[start + i] = g
        counts[g] += 1
        seen[i] = counts[g]
        in_flight[i] = start + i + 1 - departed
    after = times >= warm_up_s
    measured = seen[after]
    ttfa = capacity.ttfa(measured)
    return Run(
        ttfa_p90_ms=float(np.percentile(ttfa, 90)),
        ttfa_p99_ms=float(np.percentile(ttfa, 99)),
        excess_p99=float(np.percentile(measured - in_flight[after] / gpus, 99)),
        stalled=int(np.count_nonzero(measured > capacity.stall_streams)),
        requests=int(measured.size),
    )


def _equilibrium_residual(u: np.ndarray, lo: float, hi: float) -> np.ndarray:
    """Inverse CDF of the residual length of U(lo, hi) streams seen in flight at a random time."""
    mean = (lo + hi) / 2
    flat = u * mean <= lo  # residuals below lo: density 1 / mean
    # Above lo the density is (hi - x) / ((hi - lo) * mean); solve the quadratic CDF for x.
    rest = (u * mean - lo) * 2 * (hi - lo)
    return np.where(flat, u * mean, hi - np.sqrt(np.maximum((hi - lo) ** 2 - rest, 0.0)))


class _Router:
    """Picks a GPU per arrival; `departed` tells it a stream ended (only some policies care)."""

    def departed(self, gpu: int, stream: int) -> None:
        pass


class _LeastRequest(_Router):
    def __call__(self, i, t, counts, stream):
        return int(counts.argmin())


class _Random(_Router):
    def __init__(self, choices):
        self.choices = choices

    def __call__(self, i, t, counts, stream):
        return self.choices[i]


class _PowerOfTwo(_Router):
    def __init__(self, first, second):
        self.first, self.second = first, second

    def __call__(self, i, t, counts, stream):
        a, b = self.first[i], self.second[i]
        return b if counts[b] < counts[a] else a


class _Proxies(_Router):
    """k proxies, each least-request over its own streams; each breaks ties in its own GPU order."""

    def __init__(self, rng, gpus, proxy, start_gpus):
        self.proxy = proxy.tolist()
        k = int(proxy.max()) + 1 if proxy.size else 1
        self.order = np.array([rng.permutation(gpus) for _ in range(k)])
        self.views = np.zeros((k, gpus), dtype=np.int64)
        np.add.at(self.views, (proxy[: start_gpus.size], start_gpus), 1)

    def __call__(self, i, t, counts, stream):
        p = self.proxy[stream]
        g = int(self.order[p][self.views[p][self.order[p]].argmin()])
        self.views[p, g] += 1
        return g

    def departed(self, gpu, stream):
        self.views[self.proxy[stream], gpu] -= 1


class _Stale(_Router):
    """Least-request on the last scrape of every GPU's count plus the streams sent since."""

    def __init__(self, scrape_s):
        self.scrape_s, self.next_scrape, self.view = scrape_s, 0.0, None

    def __call__(self, i, t, counts, stream):
        if t >= self.next_scrape:
            self.view = counts.copy()
            self.next_scrape = (t // self.scrape_s + 1) * self.scrape_s
        g = int(self.view.argmin())
        self.view[g] += 1
        return g


def _router(policy, rng, gpus, arrivals, start_gpus, proxy, scrape_s) -> _Router:
    if policy == "least_request":
        return _LeastRequest()
    if policy == "random":
        return _Random(rng.integers(0, gpus, arrivals).tolist())
    if policy == "p2c":
        first = rng.integers(0, gpus, arrivals)
        second = (first + rng.integers(1, max(gpus, 2), arrivals)) % gpus  # a different GPU
        return _PowerOfTwo(first.tolist(), second.tolist())
    if policy == "k_proxies":
        return _Proxies(rng, gpus, proxy, start_gpus)
    return _Stale(scrape_s)


def goodput(capacity: Capacity, policy: str, gpus: int, steps: int = 6, **run_options) -> float:
    """The highest per-GPU rate that passes (p90 TTFA <= 200 ms, no stall), by bisection over
    0.7-1.1x the measured goodput; the same seed at every rate (common random numbers)."""
    lo, hi = 0.7 * capacity.goodput, 1.1 * capacity.goodput
    if not simulate(capacity, policy, gpus, lo, **run_options).passed:
        return 0.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        if simulate(capacity, policy, gpus, mid, **run_options).passed:
            lo = mid
        else:
            hi = mid
    return lo

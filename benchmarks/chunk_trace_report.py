"""Where late chunks lost their time, from a server's chunk trace (tts `chunk_trace_path`).

First chunks: the server's part of TTFA split into encoding (a request's reference recording),
generation (admission, prefill and the first frames), the wait for a codec lane, the codec call and
the send, at p50 and p90, over the slowest tenth, and per time window; and for in-context voices,
when their codec priming ended against when the first chunk's frames were cut.
Last chunks of input streams: the last word to the last audio split into the frames after the text
ended, the wait for a codec lane, the codec call and the send, with the frame steps in between.
Per chunk index: how long after the stream's first chunk was sent the chunk was cut (its frames
generated, or its predecessor done) and how long it then waited for its codec lane. Late chunks (sent
after they were due) by index and lane. All chunks and late ones by route: the lane they were
routed to, or for urgent-lane chunks queued for the background lane first, how they moved
(promoted as their deadline neared, or taken by an idle urgent lane). The frame period over the
course of the run, measured from streams whose fifth chunk waited for its frames, per time window,
and, where the trace has the engine's step lines, each window's frame steps split into their parts.
Per window and lane, the codec calls (chunks sent with the same lane, start and end are one call)
and the share of the window they covered. Per lane, the gaps between consecutive calls, split by
whether a chunk of the next call was already waiting when the previous call ended: time in such
gaps is the lane's own host work (sending the audio, taking the next batch, the service lock), not
a lack of chunks.

    python benchmarks/chunk_trace_report.py TRACE.jsonl[.gz] [--window 4]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from voxtriton.bench.chunk_trace import read_trace, report


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("trace", type=Path)
    parser.add_argument("--window", type=float, default=4.0, help="seconds per frame-period window")
    args = parser.parse_args()
    print(json.dumps(report(read_trace(args.trace), args.window), indent=2))


if __name__ == "__main__":
    main()

"""`voxtriton-client speak "Hello!" -o hello.wav --max-frames 50`: stream speech, write the WAV as it
arrives, report each chunk, the TTFA and the stalls. With "-" as the text, each line read from stdin
streams in as it comes (input streaming): speech starts before the text ends."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .api import LANES, SAMPLE_RATE, TTSClient
from .wav import StreamingWavWriter


def speak(args: argparse.Namespace) -> int:
    output = Path(args.output)
    if not output.parent.is_dir():
        print(f"error: -o/--output: no directory {str(output.parent)!r}", file=sys.stderr)
        return 2
    if output.exists() and not output.is_file():  # a directory, a device, a pipe: the WAV header is
        # rewritten at the end, and a failed synthesis removes its file
        print(f"error: -o/--output: {args.output!r} is not a regular file", file=sys.stderr)
        return 2
    if "://" in args.server:
        print(
            f"error: --server: Triton's gRPC address as HOST:PORT, without a scheme, got {args.server!r}",
            file=sys.stderr,
        )
        return 2
    reference = None
    if args.reference_audio is not None:
        try:
            reference = Path(args.reference_audio).read_bytes()
        except OSError as error:
            print(
                f"error: --reference-audio: cannot read {args.reference_audio!r}: {error.strerror}",
                file=sys.stderr,
            )
            return 2
    client = TTSClient(args.server)
    options = dict(
        speaker=args.speaker,
        language=args.language,
        instruct=args.instruct,
        seed=args.seed,
        max_frames=args.max_frames,
        ignore_eos=args.ignore_eos or None,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        reference_audio=reference,
        reference_text=args.reference_text,
        start_frames=args.start_frames,
    )
    with StreamingWavWriter(output, SAMPLE_RATE) as wav:

        def on_chunk(chunk):
            if wav.samples == 0:
                print(f"{'chunk':>5} {'arrived ms':>10} {'audio ms':>8} {'lane':>10}")
            wav.write(chunk.audio)
            lane = LANES.get(int(chunk.info[3]), "?") if chunk.info is not None else ""
            index = int(chunk.info[0]) if chunk.info is not None else ""
            print(
                f"{index:>5} {chunk.arrived_s * 1000:>10.1f} {chunk.seconds * 1000:>8.0f} {lane:>10}",
                flush=True,
            )

        if args.text == "-":
            lines = (line.replace("\n", " ") for line in sys.stdin)
            synthesis = client.synthesize_text_stream(lines, on_chunk=on_chunk, info=True, **options)
        else:
            synthesis = client.synthesize(args.text, on_chunk=on_chunk, info=True, **options)
    if synthesis.error:
        output.unlink(missing_ok=True)  # no file that looks like a result
        print(f"error: {synthesis.error}{connection_hint(synthesis.error, args.server)}", file=sys.stderr)
        return 1
    report = synthesis.playback
    print(
        f"TTFA {report.ttfa_s * 1000:.1f} ms, {report.audio_s:.2f} s of audio in "
        f"{len(synthesis.chunks)} chunks, {stall_summary(report)} under simulated playback; "
        f"wrote {args.output}"
    )
    if synthesis.last_audio_after_last_piece_s is not None:
        print(f"last audio {synthesis.last_audio_after_last_piece_s * 1000:.1f} ms after the last line")
    return 0


def connection_hint(error: str, server: str) -> str:
    if "failed to connect" in error or "Connection refused" in error:
        return (
            f"\n(no Triton server answers at {server}: start one with `voxtriton serve`, or pass --server "
            "with Triton's gRPC port, 8001 by default, not its HTTP port or the gateway's)"
        )
    if "has no available versions" in error:
        return (
            f"\n(the server at {server} has not loaded its tts model yet: wait for `voxtriton serve`'s ready)"
        )
    return ""


def stall_summary(report) -> str:
    if not report.stalls:
        return "no stall"
    return f"{report.stalls} stall{'s' if report.stalls > 1 else ''} ({report.stall_s * 1000:.1f} ms)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="voxtriton-client")
    commands = parser.add_subparsers(dest="command", required=True)
    say = commands.add_parser("speak", help="synthesize text to a WAV file, streaming")
    say.add_argument("text", help='the text; "-": read it from stdin, speaking each line as it comes')
    say.add_argument("-o", "--output", required=True)
    say.add_argument(
        "--server", default="127.0.0.1:8001", help="Triton gRPC address (default 127.0.0.1:8001)"
    )
    say.add_argument("--speaker", help="a preset speaker, a speaker id (CSM) or a registered voice (Base)")
    say.add_argument("--language")
    say.add_argument("--instruct")
    say.add_argument("--seed", type=int)
    say.add_argument(
        "--max-frames",
        type=int,
        help="most frames to generate, 12.5 a second (a random-weight model rarely stops by itself)",
    )
    say.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate --max-frames frames whatever the model samples (a fixed length, for tests)",
    )
    say.add_argument("--temperature", type=float)
    say.add_argument("--top-p", type=float)
    say.add_argument("--top-k", type=int)
    say.add_argument(
        "--reference-audio",
        metavar="FILE",
        help="Base checkpoints: clone the voice of this recording (WAV, FLAC, ...; 1-30 s)",
    )
    say.add_argument(
        "--reference-text", help="the recording's transcript: the in-context prompt (better likeness)"
    )
    say.add_argument(
        "--start-frames",
        type=int,
        help='with "-": frames the first chunk holds at least, its buffer against slow lines '
        "(default: the server's scheduler_text_start_frames)",
    )
    say.set_defaults(run=speak)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

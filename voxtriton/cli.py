"""`voxtriton` command line: make-checkpoint, serve, gateway, voices."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def make_csm_checkpoint_command(args: argparse.Namespace) -> int:
    from .models.csm.checkpoint import make_csm_checkpoint

    out = make_csm_checkpoint(
        args.preset, Path(args.out_dir), seed=args.seed, tokenizer=not args.no_tokenizer
    )
    print(f"wrote a random-weight {args.preset} checkpoint (it produces noise, not speech) to {out}")
    return 0


def make_checkpoint_command(args: argparse.Namespace) -> int:
    from .models.random_checkpoint import make_checkpoint

    if args.preset.startswith("csm-") and args.shard_mb:
        raise SystemExit("--shard-mb: CSM checkpoints are written as one model.safetensors")
    out_dir = Path(args.out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        # Files left there (an index, shards, a tokenizer) would be read with or instead of the new
        # ones, and a real checkpoint would be overwritten with noise.
        print(
            f"voxtriton make-checkpoint: {args.out_dir!r} is not an empty directory; name a new or empty one",
            file=sys.stderr,
        )
        return 2
    if args.preset.startswith("csm-"):
        return make_csm_checkpoint_command(args)
    out = make_checkpoint(
        args.preset,
        Path(args.out_dir),
        seed=args.seed,
        shard_mb=args.shard_mb,
        tokenizer=not args.no_tokenizer,
    )
    print(f"wrote a random-weight {args.preset} checkpoint (it produces noise, not speech) to {out}")
    return 0


def serve_command(args: argparse.Namespace) -> int:
    from .launch.serve import serve

    return serve(args)


def gateway_command(args: argparse.Namespace) -> int:
    from .serving.gateway import run_gateway

    return run_gateway(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="voxtriton", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    make = commands.add_parser(
        "make-checkpoint", help="write a random-weight checkpoint in the official layout"
    )
    make.add_argument(
        "--preset",
        choices=("tiny", "0.6b", "1.7b", "tiny-base", "0.6b-base", "1.7b-base", "csm-tiny", "csm-1b"),
        required=True,
    )
    make.add_argument("out_dir")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument(
        "--shard-mb", type=int, default=None, help="write model.safetensors in shards of this size"
    )
    make.add_argument(
        "--no-tokenizer",
        action="store_true",
        help="leave out the text tokenizer files (the server then uses its byte-level fallback)",
    )
    make.set_defaults(run=make_checkpoint_command)

    from .launch.serve import add_serve_arguments

    serve = commands.add_parser("serve", help="start tritonserver with the voxtriton model repository")
    add_serve_arguments(serve)
    serve.set_defaults(run=serve_command)

    from .serving.gateway import add_gateway_arguments

    gateway = commands.add_parser(
        "gateway", help="OpenAI-compatible HTTP speech endpoint and browser playground"
    )
    add_gateway_arguments(gateway)
    gateway.set_defaults(run=gateway_command)

    from .serving.voices_cli import add_voices_arguments, voices_command

    voices = commands.add_parser("voices", help="register, list and delete cloned voices (Base checkpoints)")
    add_voices_arguments(voices)
    voices.set_defaults(run=voices_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())

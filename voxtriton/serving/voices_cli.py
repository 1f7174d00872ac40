"""`voxtriton voices add|list|delete`: registered voices of a checkpoint that clones voices (Qwen3-TTS
Base, CSM), on this machine's disk.

A server reading the same voices directory (`voices_dir`) serves a voice added here at its next
request naming it, without restarting.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import RequestError


def add_voices_arguments(parser: argparse.ArgumentParser) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--checkpoint", required=True, help="the checkpoint directory the voices are for (Base or CSM)"
    )
    common.add_argument("--voices-dir", default="", help="where voices are kept (default: <cache>/voices)")
    actions = parser.add_subparsers(dest="action", required=True)
    add = actions.add_parser(
        "add", parents=[common], help="encode a reference recording once and register it as NAME"
    )
    add.add_argument("name")
    add.add_argument("--audio", required=True, help="the recording: WAV or FLAC, 1 to 30 s, any sample rate")
    add.add_argument(
        "--text", help="its transcript: in-context cloning (without: x-vector only); required for CSM"
    )
    add.add_argument("--replace", action="store_true", help="replace a voice of that name")
    add.add_argument("--device", default="cpu", help="where the encoders run (cpu, cuda, cuda:N)")
    add.add_argument(
        "--max-voices",
        type=int,
        default=None,
        help="refuse a new voice past N in the directory, as the servers' max_voices (default: theirs, 1000)",
    )
    actions.add_parser("list", parents=[common], help="the registered voices")
    delete = actions.add_parser("delete", parents=[common], help="remove a registered voice")
    delete.add_argument("name")


def voices_command(args: argparse.Namespace) -> int:
    from ..models.config import CheckpointError
    from ..models.families import load_family
    from .settings import TTSSettings, voices_dir
    from .voices import VoiceEncoder, VoiceStore, register_voice

    try:
        family = load_family(Path(args.checkpoint))
    except CheckpointError as error:
        print(
            f"voxtriton voices: --checkpoint: {error} (voices need a Qwen3-TTS Base or a CSM checkpoint)",
            file=sys.stderr,
        )
        return 2
    max_voices = getattr(args, "max_voices", None)
    if max_voices is not None and max_voices < 1:
        print(f"voxtriton voices: --max-voices: must be at least 1, got {max_voices}", file=sys.stderr)
        return 2
    directory = voices_dir(args.voices_dir)
    if directory.exists() and not directory.is_dir():
        print(f"voxtriton voices: --voices-dir: {str(directory)!r} is not a directory", file=sys.stderr)
        return 2
    store = VoiceStore(directory, family, max_voices or TTSSettings.max_voices)
    try:
        if not family.clones_voices:
            kind = getattr(family.config, "model_type", family.name)
            raise RequestError("checkpoint", f"is {kind}; voices need a Qwen3-TTS Base or a CSM checkpoint")
        if args.action == "add":
            try:
                audio = Path(args.audio).read_bytes()
            except OSError as error:
                raise RequestError("audio", f"cannot read {args.audio}: {error.strerror}") from None
            encoder = VoiceEncoder(family, args.device)
            print(json.dumps(register_voice(store, encoder, args.name, audio, args.text, args.replace)))
        elif args.action == "list":
            described = store.descriptions(
                lambda name, error: print(
                    f"voxtriton voices: left out {name}: {error.problem}", file=sys.stderr
                )
            )
            for description in described:
                print(json.dumps(description))
            if not described:  # stdout stays JSON lines (none here); the notes go to stderr
                print(f"voxtriton voices: no registered voices in {store.directory}", file=sys.stderr)
        elif not store.delete(args.name):
            raise RequestError("name", f"no voice {args.name!r} in {store.directory}")
    except RequestError as error:
        print(f"voxtriton voices: {error}", file=sys.stderr)
        return 2
    return 0

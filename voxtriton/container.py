"""The Docker image's entrypoint: which command runs, with which checkpoint, from argv and environment.

`plan` decides (a function of its inputs, tested on CPU); `main` prints its notice and execs the command,
so the server it starts receives the container's signals directly.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .models.config import CheckpointError
from .models.families import load_family

MOUNT = Path("/models/checkpoint")  # where docker/README.md tells users to mount a checkpoint
REPOSITORY = Path("/opt/voxtriton/src/model_repository")  # the Dockerfile copies it here


class EntrypointError(Exception):
    """The container cannot start as asked; the message is the one line it prints."""


@dataclass(frozen=True)
class Plan:
    argv: list[str]
    notice: str | None = None  # printed to stderr before the command runs


def plan(
    args: Sequence[str], env: Mapping[str, str], mount: Path = MOUNT, repository: Path = REPOSITORY
) -> Plan:
    """`serve` (the default, also when the first argument is an option), `gateway`, or any command as is."""
    command, rest = (
        (args[0], list(args[1:])) if args and not args[0].startswith("-") else ("serve", list(args))
    )
    if command == "gateway":
        return Plan(["voxtriton", "gateway", "--host", "0.0.0.0", *rest])
    if command != "serve":
        return Plan([command, *rest])
    argv = ["voxtriton", "serve", "--host", "0.0.0.0", "--model-repository", str(repository)]
    if any(arg == "--checkpoint" or arg.startswith("--checkpoint=") for arg in rest):
        return Plan(argv + rest)  # the user chose a checkpoint; `voxtriton serve` checks it
    checkpoint, notice = mounted_checkpoint(env, mount)
    return Plan(argv + (["--checkpoint", str(checkpoint)] if checkpoint else []) + rest, notice)


def mounted_checkpoint(env: Mapping[str, str], mount: Path) -> tuple[Path | None, str | None]:
    """The checkpoint at VOXTRITON_CHECKPOINT (else the mount point), or None and a notice when it is empty.

    An empty or absent mount serves the built-in random-weight checkpoint; a directory that holds files
    must be a checkpoint; a VOXTRITON_CHECKPOINT that names nothing is a mistake, not a default.
    """
    named = env.get("VOXTRITON_CHECKPOINT")
    path = Path(named) if named else mount
    if not path.exists():
        if named:
            raise EntrypointError(f"VOXTRITON_CHECKPOINT={named}: no such directory")
        return None, noise_notice(path)
    if not path.is_dir():
        raise EntrypointError(f"{path}: is a file, not a checkpoint directory")
    if not any(not entry.name.startswith(".") for entry in path.iterdir()):
        if (path / ".cache" / "huggingface").is_dir():  # `hf download --local-dir` keeps its state there
            raise EntrypointError(
                f"{path} holds only an unfinished Hugging Face download (.cache/huggingface): "
                "run the download again to finish it"
            )
        return None, noise_notice(path)
    try:
        load_family(path)
    except CheckpointError as error:
        raise EntrypointError(f"{path} holds files but is not a usable checkpoint: {error}") from None
    return path, None


def noise_notice(path: Path) -> str:
    return (
        f"voxtriton: no checkpoint in {path}; serving the built-in random-weight checkpoint (noise). "
        f"Mount a checkpoint directory at {path} to serve speech."
    )


def main(argv: Sequence[str] | None = None) -> int:
    try:
        chosen = plan(sys.argv[1:] if argv is None else argv, os.environ)
    except EntrypointError as error:
        print(f"voxtriton: {error}", file=sys.stderr)
        return 2
    if chosen.notice:
        print(chosen.notice, file=sys.stderr, flush=True)
    try:
        os.execvp(chosen.argv[0], chosen.argv)
    except OSError as error:
        print(f"voxtriton: cannot run {chosen.argv[0]}: {error.strerror}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())

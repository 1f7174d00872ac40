"""Write vLLM-Omni's Qwen3-TTS deploy config with the settings to measure it at its best.

    python tune_deploy.py OUT.yaml [--initial-chunk 8] [--ramp 4,4,8,16,25] [--max-num-seqs 256]
        [--codec-max-num-seqs N] [--gpu-memory 0.45] [--replicas N]

Starts from the deploy/qwen3_tts.yaml that ships in the installed vllm_omni package (talker stage,
code2wav stage, shared-memory connector) and sets, wherever the file has them: the first audio
chunk's frames (initial_codec_chunk_frames), a chunk ramp (codec_chunk_ramp, added beside
codec_chunk_frames; when set it overrides the first-chunk size, per request too), the streams each
stage batches (max_num_seqs; --codec-max-num-seqs for the code2wav stage alone) and the GPU memory
share of each stage (gpu_memory_utilization; both stages share one GPU, so at most about 0.45 each).
CUDA graphs stay on (enforce_eager false wherever the file sets it). A setting the file lacks is an
error, not a silent no-op: the installed version may name it differently.

--replicas N runs N copies of each stage, replica r on GPU r (vLLM-Omni's num_replicas, with each
stage's one-GPU `devices` as the template it offsets by r): one server, one replica of both stages
per GPU, its head balancing requests across them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml


def tuned(config, settings: dict, ramp: list[int] | None) -> tuple[object, dict]:
    """`config` with every key of `settings` replaced where it occurs, and the ramp added to each
    mapping holding codec_chunk_frames; also how many places each key was set in."""
    found = {key: 0 for key in settings} | ({"codec_chunk_ramp": 0} if ramp else {})

    def visit(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in settings:
                    node[key] = settings[key]
                    found[key] += 1
                else:
                    visit(value)
            if ramp and "codec_chunk_frames" in node:
                node["codec_chunk_ramp"] = ramp
                found["codec_chunk_ramp"] += 1
        elif isinstance(node, list):
            for item in node:
                visit(item)

    visit(config)
    return config, found


def replicated(config: dict, replicas: int) -> dict:
    """`config` with every stage run as `replicas` copies, one per GPU. Each stage must sit on GPU 0
    alone (`devices` "0" or unset, no tensor parallelism): the template vLLM-Omni offsets to GPU r for
    replica r."""
    if replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {replicas}")
    for stage in config["stages"]:
        devices = str(stage.get("devices", "0"))
        if devices != "0" or stage.get("tensor_parallel_size", 1) != 1:
            raise ValueError(
                f"stage {stage['stage_id']}: devices {devices!r}, tensor_parallel_size "
                f"{stage.get('tensor_parallel_size', 1)}; --replicas copies a stage on GPU 0 alone"
            )
        stage["devices"], stage["num_replicas"] = devices, replicas
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--initial-chunk", type=int, default=8, help="frames of the first audio chunk")
    parser.add_argument("--ramp", help="chunk sizes of the first chunks, e.g. 4,4,8,16,25 (default: none)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="streams each stage batches")
    parser.add_argument("--codec-max-num-seqs", type=int, help="streams the code2wav stage (1) batches")
    parser.add_argument("--gpu-memory", type=float, default=0.45, help="GPU memory share of each stage")
    parser.add_argument("--replicas", type=int, default=1, help="copies of both stages, one per GPU")
    args = parser.parse_args()
    import vllm_omni  # the installed package's own deploy config is the starting point

    source = Path(vllm_omni.__file__).parent / "deploy" / "qwen3_tts.yaml"
    config = yaml.safe_load(source.read_text())
    settings = {
        "initial_codec_chunk_frames": args.initial_chunk,
        "max_num_seqs": args.max_num_seqs,
        "gpu_memory_utilization": args.gpu_memory,
        "enforce_eager": False,
    }
    ramp = [int(frames) for frames in args.ramp.split(",")] if args.ramp else None
    config, found = tuned(config, settings, ramp)
    missing = [key for key, count in found.items() if not count and key != "enforce_eager"]
    if missing:
        raise SystemExit(f"{source} has no {', '.join(missing)}: read it and set them by hand")
    if args.codec_max_num_seqs:
        [codec] = [stage for stage in config["stages"] if stage["stage_id"] == 1]
        codec["max_num_seqs"] = args.codec_max_num_seqs
    if args.replicas != 1:
        try:
            config = replicated(config, args.replicas)
        except ValueError as error:
            raise SystemExit(f"{source}: {error}") from None
    args.out.write_text(yaml.safe_dump(config, sort_keys=False))
    print(
        f"{args.out}: from {source}; set " + ", ".join(f"{key} in {n} place(s)" for key, n in found.items())
    )


if __name__ == "__main__":
    main()

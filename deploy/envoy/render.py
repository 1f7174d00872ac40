"""Write deploy/envoy/envoy.yaml for given servers, gateways and ports.

    python deploy/envoy/render.py --triton 10.0.0.5:8001:8000 --triton 10.0.0.6:8001:8000 \
        --gateway 127.0.0.1:8080 > envoy.yaml

--triton HOST:GRPC_PORT:HTTP_PORT is one tritonserver (or a DNS name for several): Envoy streams to
its gRPC port and checks /v2/models/tts/ready on its HTTP port. Everything else stays as in the file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

TEMPLATE = Path(__file__).with_name("envoy.yaml")


def endpoint(host: str, port: int, health_port: int | None = None) -> dict:
    found = {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}
    if health_port is not None:
        found["endpoint"]["health_check_config"] = {"port_value": health_port}
    return found


def address(text: str, parts: int, flag: str) -> tuple[str, ...]:
    fields = text.rsplit(":", parts - 1)
    if len(fields) != parts or not all(fields) or not all(field.isdigit() for field in fields[1:]):
        shape = "HOST:GRPC_PORT:HTTP_PORT" if parts == 3 else "HOST:PORT"
        raise SystemExit(f"{flag}: expected {shape}, got {text!r}")
    return fields[0], *(int(field) for field in fields[1:])


def render(
    tritons: list[tuple[str, int, int]],
    gateways: list[tuple[str, int]],
    grpc_port: int,
    http_port: int,
    admin_port: int,
) -> dict:
    config = yaml.safe_load(TEMPLATE.read_text())
    config["admin"]["address"]["socket_address"]["port_value"] = admin_port
    listeners = {listener["name"]: listener for listener in config["static_resources"]["listeners"]}
    listeners["grpc"]["address"]["socket_address"]["port_value"] = grpc_port
    listeners["http"]["address"]["socket_address"]["port_value"] = http_port
    clusters = {cluster["name"]: cluster for cluster in config["static_resources"]["clusters"]}
    clusters["triton"]["load_assignment"]["endpoints"] = [
        {"lb_endpoints": [endpoint(host, port, health) for host, port, health in tritons]}
    ]
    if gateways:
        clusters["gateway"]["load_assignment"]["endpoints"] = [
            {"lb_endpoints": [endpoint(host, port) for host, port in gateways]}
        ]
    else:  # gRPC only
        del listeners["http"], clusters["gateway"]
    config["static_resources"]["listeners"] = list(listeners.values())
    config["static_resources"]["clusters"] = list(clusters.values())
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--triton", action="append", required=True, metavar="HOST:GRPC_PORT:HTTP_PORT")
    parser.add_argument("--gateway", action="append", default=[], metavar="HOST:PORT")
    parser.add_argument("--grpc-port", type=int, default=9001, help="Envoy's gRPC listener")
    parser.add_argument("--http-port", type=int, default=9080, help="Envoy's HTTP listener (gateways)")
    parser.add_argument("--admin-port", type=int, default=9901, help="Envoy's admin (loopback)")
    args = parser.parse_args(argv)
    config = render(
        [address(text, 3, "--triton") for text in args.triton],
        [address(text, 2, "--gateway") for text in args.gateway],
        args.grpc_port,
        args.http_port,
        args.admin_port,
    )
    yaml.safe_dump(config, sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``polytrain devices``: what this process can use (honours CUDA_VISIBLE_DEVICES)."""

from __future__ import annotations

import argparse
import json
from typing import Any


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("devices", help="list the devices this process can use",
                            description="List the CPU (with its core count), CUDA devices (name, memory) "
                                        "and MPS that this process can use. CUDA_VISIBLE_DEVICES is honoured: "
                                        "indices are the visible ones, as PyTorch numbers them.")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from polytrain.devices.discovery import format_devices, list_devices

    devices = list_devices()
    if args.json:
        print(json.dumps([d.to_dict() for d in devices], indent=2))
    else:
        print(format_devices(devices))
    return 0

"""Devices: one parser for device names, discovery, explicit placement, the placement log, soft placement,
the GPU memory cap and the CPU allocator setting. docs/devices.md is the user guide; docs/migration.md maps
TensorFlow's names here.

The names below are imported from their modules on first use (PEP 562), so that ``polytrain devices``, which
needs discovery alone, does not import torch where the build has no GPU to ask about.
"""

import importlib as _importlib

_EXPORTS = {
    **{name: "polytrain.devices.config" for name in ("DeviceConfig", "check_device_config")},
    **{name: "polytrain.devices.discovery" for name in ("DeviceInfo", "available_device_names", "format_devices",
                                                        "list_devices", "usable_cores")},
    **{name: "polytrain.devices.host_memory" for name in ("describe_host_memory", "set_host_memory")},
    **{name: "polytrain.devices.memory" for name in ("check_memory_fraction", "set_gpu_memory_fraction")},
    **{name: "polytrain.devices.placement" for name in ("device", "install_input_hooks", "model_devices",
                                                        "model_input_device", "model_output_device", "place")},
    **{name: "polytrain.devices.placement_log" for name in ("OpDeviceLog", "OpRecord", "PlacementLogger",
                                                            "log_placement", "module_table")},
    "PlacementPlan": "polytrain.devices.plan",
    "DeviceRuntime": "polytrain.devices.runtime",
    **{name: "polytrain.devices.soft" for name in ("SoftPlacementMode", "device_error_for", "operator_errors")},
    **{name: "polytrain.devices.spec" for name in ("DeviceSpec", "default_backend", "parse_device",
                                                   "resolve_device")},
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'polytrain.devices' has no attribute {name!r}")
    value = getattr(_importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

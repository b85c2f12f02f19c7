"""Devices: one parser for device names, discovery, explicit placement, the placement log, soft placement,
the GPU memory cap and the CPU allocator setting. docs/devices.md is the user guide; docs/migration.md maps
TensorFlow's names here.
"""

from polytrain.devices.config import DeviceConfig, check_device_config
from polytrain.devices.discovery import (
    DeviceInfo,
    available_device_names,
    format_devices,
    list_devices,
    usable_cores,
)
from polytrain.devices.host_memory import describe_host_memory, set_host_memory
from polytrain.devices.memory import check_memory_fraction, set_gpu_memory_fraction
from polytrain.devices.placement import (
    device,
    install_input_hooks,
    model_devices,
    model_input_device,
    model_output_device,
    place,
)
from polytrain.devices.placement_log import (
    OpDeviceLog,
    OpRecord,
    PlacementLogger,
    log_placement,
    module_table,
)
from polytrain.devices.plan import PlacementPlan
from polytrain.devices.runtime import DeviceRuntime
from polytrain.devices.soft import SoftPlacementMode, device_error_for, operator_errors
from polytrain.devices.spec import DeviceSpec, default_backend, parse_device, resolve_device

__all__ = [
    "DeviceConfig", "DeviceInfo", "DeviceRuntime", "DeviceSpec", "OpDeviceLog", "OpRecord", "PlacementLogger", "PlacementPlan",
    "SoftPlacementMode", "available_device_names", "check_device_config", "check_memory_fraction", "default_backend",
    "describe_host_memory", "device",
    "device_error_for", "format_devices", "install_input_hooks", "list_devices", "log_placement",
    "model_devices", "model_input_device", "model_output_device", "module_table", "operator_errors",
    "parse_device", "place", "resolve_device", "set_gpu_memory_fraction", "set_host_memory", "usable_cores",
]

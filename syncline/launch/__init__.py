"""Launcher layer: how ranks are started, including on an emulated slow network."""

from syncline.launch.netns import (
    HOST_IFNAME,
    EmulatedNetwork,
    NetworkEmulationError,
    check_prerequisites,
    cleanup_stale,
    parse_rate,
)

__all__ = [
    "HOST_IFNAME",
    "EmulatedNetwork",
    "NetworkEmulationError",
    "check_prerequisites",
    "cleanup_stale",
    "parse_rate",
]

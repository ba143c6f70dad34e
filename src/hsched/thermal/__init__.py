"""Thermal surrogate of a data-center room (paper 003): power, recirculation, temperatures, CRAC, PUE."""

from .cooling import cooling_power, cop, pue
from .power import gpu_power, server_power
from .recirculation import (
    CP_AIR_J_PER_KG_K,
    DEFAULT_AIR_MASS_FLOW_KG_S,
    Calibration,
    RoomGeometry,
    calibrate_recirculation,
    recirculation_from_geometry,
)
from .room import RoomModel, ThermalParams, ThermalState, rack_outlet_mean
from .zonal import RiseTracker, ZonalRecirculation

__all__ = [
    "CP_AIR_J_PER_KG_K",
    "DEFAULT_AIR_MASS_FLOW_KG_S",
    "Calibration",
    "RiseTracker",
    "RoomGeometry",
    "RoomModel",
    "ThermalParams",
    "ThermalState",
    "ZonalRecirculation",
    "calibrate_recirculation",
    "cooling_power",
    "cop",
    "gpu_power",
    "pue",
    "rack_outlet_mean",
    "recirculation_from_geometry",
    "server_power",
]

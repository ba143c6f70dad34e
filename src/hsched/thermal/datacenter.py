"""The thermal model of a fleet data center: its room geometry and servers from the fleet description."""

from __future__ import annotations

import numpy as np

from hsched.domain.cluster import ClusterState
from hsched.domain.fleet import DataCenter
from hsched.domain.resources import MILLI
from hsched.thermal.recirculation import CP_AIR_J_PER_KG_K, DEFAULT_AIR_MASS_FLOW_KG_S, RoomGeometry
from hsched.thermal.room import RoomModel, ThermalParams, ThermalState
from hsched.thermal.zonal import ZonalRecirculation

RACK_HEIGHT_U = 42
U_M = 0.04445
DESIGN_RISE_K = 12.0  # server fans are sized for ~10-15 K across the server at full power


def room_for(dc: DataCenter, recirc: ZonalRecirculation | None = None) -> RoomModel:
    """A RoomModel for `dc`: geometry from its layout (`geometry_for`), one server per node, with the zonal
    recirculation model of that geometry (O(n): docs/thermal.md), or `recirc` (a published version of it).

    Unless the fleet sets `thermal.air_mass_flow_kg_s`, the per-server air flow is sized for a 12 K rise
    at the DC's largest full power, so multi-kW GPU servers get proportionally more air than 1U boxes.
    """
    t = dc.node_table()
    thermal = _params(dc)
    d = recirc if recirc is not None else ZonalRecirculation.from_geometry(geometry_for(dc)).head(len(t))
    # (empty slots draw nothing: the head of the layout's operator)
    return RoomModel(d, thermal, p_idle_w=t.p_idle_w, p_full_w=t.p_full_w, total_cores=t.cpu_milli / MILLI,
                     gpu_count=t.gpu_count, gpu_idle_w=t.gpu_idle_w, gpu_full_w=t.gpu_full_w)


def _params(dc: DataCenter) -> ThermalParams:
    t = dc.node_table()
    full = t.p_full_w + t.gpu_count * t.gpu_full_w
    params = dict(dc.thermal)
    params.setdefault("air_mass_flow_kg_s", max(DEFAULT_AIR_MASS_FLOW_KG_S,
                                                float(full.max()) / (CP_AIR_J_PER_KG_K * DESIGN_RISE_K)))
    return ThermalParams(**params)


def geometry_for(dc: DataCenter) -> RoomGeometry:
    """The room geometry of `dc`'s layout (slots share a 42U rack height), with its thermal air flow and the
    recirculation parameters its fleet entry sets (`room:`; the RoomGeometry defaults otherwise)."""
    lay, thermal = dc.layout, _params(dc)
    return RoomGeometry(n_racks=lay.racks, racks_per_row=lay.racks // lay.rows, servers_per_rack=lay.servers_per_rack,
                        slot_height_m=U_M * RACK_HEIGHT_U / lay.servers_per_rack,
                        air_mass_flow_kg_s=thermal.air_mass_flow_kg_s, cp_air=thermal.cp_air, **dc.room)


def room_state(room: RoomModel, cluster: ClusterState) -> ThermalState:
    return room.evaluate(cluster.busy_cpu() / MILLI, cluster.busy_gpu_cards())


def load_arrays(cluster: ClusterState) -> tuple[np.ndarray, np.ndarray]:
    """(busy cores, busy GPU cards) per node — the room model's inputs."""
    return cluster.busy_cpu() / MILLI, cluster.busy_gpu_cards()

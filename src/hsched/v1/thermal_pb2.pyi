from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LoadDelta(_message.Message):
    __slots__ = ("node_index", "cpu_milli", "gpu_busy")
    NODE_INDEX_FIELD_NUMBER: _ClassVar[int]
    CPU_MILLI_FIELD_NUMBER: _ClassVar[int]
    GPU_BUSY_FIELD_NUMBER: _ClassVar[int]
    node_index: int
    cpu_milli: int
    gpu_busy: float
    def __init__(self, node_index: _Optional[int] = ..., cpu_milli: _Optional[int] = ..., gpu_busy: _Optional[float] = ...) -> None: ...

class PredictRequest(_message.Message):
    __slots__ = ("datacenter", "deltas", "min_ledger_id", "want_headroom")
    DATACENTER_FIELD_NUMBER: _ClassVar[int]
    DELTAS_FIELD_NUMBER: _ClassVar[int]
    MIN_LEDGER_ID_FIELD_NUMBER: _ClassVar[int]
    WANT_HEADROOM_FIELD_NUMBER: _ClassVar[int]
    datacenter: str
    deltas: _containers.RepeatedCompositeFieldContainer[LoadDelta]
    min_ledger_id: str
    want_headroom: bool
    def __init__(self, datacenter: _Optional[str] = ..., deltas: _Optional[_Iterable[_Union[LoadDelta, _Mapping]]] = ..., min_ledger_id: _Optional[str] = ..., want_headroom: _Optional[bool] = ...) -> None: ...

class PredictResponse(_message.Message):
    __slots__ = ("max_inlet_before_c", "max_inlet_after_c", "pue_before", "pue_after", "t_supply_c", "redline_c", "nodes_over_redline", "headroom_w", "ledger_id", "model_version")
    MAX_INLET_BEFORE_C_FIELD_NUMBER: _ClassVar[int]
    MAX_INLET_AFTER_C_FIELD_NUMBER: _ClassVar[int]
    PUE_BEFORE_FIELD_NUMBER: _ClassVar[int]
    PUE_AFTER_FIELD_NUMBER: _ClassVar[int]
    T_SUPPLY_C_FIELD_NUMBER: _ClassVar[int]
    REDLINE_C_FIELD_NUMBER: _ClassVar[int]
    NODES_OVER_REDLINE_FIELD_NUMBER: _ClassVar[int]
    HEADROOM_W_FIELD_NUMBER: _ClassVar[int]
    LEDGER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    max_inlet_before_c: float
    max_inlet_after_c: float
    pue_before: float
    pue_after: float
    t_supply_c: float
    redline_c: float
    nodes_over_redline: _containers.RepeatedScalarFieldContainer[int]
    headroom_w: _containers.RepeatedScalarFieldContainer[float]
    ledger_id: str
    model_version: int
    def __init__(self, max_inlet_before_c: _Optional[float] = ..., max_inlet_after_c: _Optional[float] = ..., pue_before: _Optional[float] = ..., pue_after: _Optional[float] = ..., t_supply_c: _Optional[float] = ..., redline_c: _Optional[float] = ..., nodes_over_redline: _Optional[_Iterable[int]] = ..., headroom_w: _Optional[_Iterable[float]] = ..., ledger_id: _Optional[str] = ..., model_version: _Optional[int] = ...) -> None: ...

class ThermalStateRequest(_message.Message):
    __slots__ = ("datacenter", "include_nodes")
    DATACENTER_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_NODES_FIELD_NUMBER: _ClassVar[int]
    datacenter: str
    include_nodes: bool
    def __init__(self, datacenter: _Optional[str] = ..., include_nodes: _Optional[bool] = ...) -> None: ...

class RoomState(_message.Message):
    __slots__ = ("datacenter", "it_power_w", "cooling_power_w", "other_power_w", "pue", "t_supply_c", "max_inlet_c", "mean_outlet_c", "inlet_c", "outlet_c", "power_w", "rack_outlet_mean_c", "ledger_id", "redline_c")
    DATACENTER_FIELD_NUMBER: _ClassVar[int]
    IT_POWER_W_FIELD_NUMBER: _ClassVar[int]
    COOLING_POWER_W_FIELD_NUMBER: _ClassVar[int]
    OTHER_POWER_W_FIELD_NUMBER: _ClassVar[int]
    PUE_FIELD_NUMBER: _ClassVar[int]
    T_SUPPLY_C_FIELD_NUMBER: _ClassVar[int]
    MAX_INLET_C_FIELD_NUMBER: _ClassVar[int]
    MEAN_OUTLET_C_FIELD_NUMBER: _ClassVar[int]
    INLET_C_FIELD_NUMBER: _ClassVar[int]
    OUTLET_C_FIELD_NUMBER: _ClassVar[int]
    POWER_W_FIELD_NUMBER: _ClassVar[int]
    RACK_OUTLET_MEAN_C_FIELD_NUMBER: _ClassVar[int]
    LEDGER_ID_FIELD_NUMBER: _ClassVar[int]
    REDLINE_C_FIELD_NUMBER: _ClassVar[int]
    datacenter: str
    it_power_w: float
    cooling_power_w: float
    other_power_w: float
    pue: float
    t_supply_c: float
    max_inlet_c: float
    mean_outlet_c: float
    inlet_c: _containers.RepeatedScalarFieldContainer[float]
    outlet_c: _containers.RepeatedScalarFieldContainer[float]
    power_w: _containers.RepeatedScalarFieldContainer[float]
    rack_outlet_mean_c: _containers.RepeatedScalarFieldContainer[float]
    ledger_id: str
    redline_c: float
    def __init__(self, datacenter: _Optional[str] = ..., it_power_w: _Optional[float] = ..., cooling_power_w: _Optional[float] = ..., other_power_w: _Optional[float] = ..., pue: _Optional[float] = ..., t_supply_c: _Optional[float] = ..., max_inlet_c: _Optional[float] = ..., mean_outlet_c: _Optional[float] = ..., inlet_c: _Optional[_Iterable[float]] = ..., outlet_c: _Optional[_Iterable[float]] = ..., power_w: _Optional[_Iterable[float]] = ..., rack_outlet_mean_c: _Optional[_Iterable[float]] = ..., ledger_id: _Optional[str] = ..., redline_c: _Optional[float] = ...) -> None: ...

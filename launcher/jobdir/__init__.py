"""The job directory: its layout, its typed records, and the only code that reads or writes it."""

from launcher.jobdir.atomic import append_json_line, read_json, write_json_atomic, write_text_atomic
from launcher.jobdir.layout import JobDir, StateWriter
from launcher.jobdir.process import NotTheDriver, driver_pid, is_same_process, start_ticks
from launcher.jobdir.records import (
    FINAL_PHASES,
    LOST,
    PHASES,
    STOPPED,
    ControlRequests,
    EngineEntry,
    EngineListing,
    FleetEngineRecord,
    FleetSnapshot,
    GatewayMemberRecord,
    GatewaySnapshot,
    JobResult,
    SubmittedJob,
    engine_id,
    lost_detail,
)

__all__ = [
    "FINAL_PHASES",
    "LOST",
    "PHASES",
    "STOPPED",
    "ControlRequests",
    "EngineEntry",
    "EngineListing",
    "FleetEngineRecord",
    "FleetSnapshot",
    "GatewayMemberRecord",
    "GatewaySnapshot",
    "JobDir",
    "JobResult",
    "NotTheDriver",
    "StateWriter",
    "SubmittedJob",
    "append_json_line",
    "driver_pid",
    "engine_id",
    "is_same_process",
    "lost_detail",
    "read_json",
    "start_ticks",
    "write_json_atomic",
    "write_text_atomic",
]

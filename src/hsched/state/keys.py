"""Redis key names. One prefix per deployment (tests use a unique one each, and delete it afterwards)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "hsched"

    def ledger(self, dc: str) -> str:
        """Stream of alloc/free/defer events; writer: that DC's placer (fenced)."""
        return f"{self.prefix}:dc:{dc}:ledger"

    def snapshot(self, dc: str) -> str:
        """Hash {id, s}: the ledger's fold up to entry `id` (JSON `s`); the stream is trimmed below it (fenced)."""
        return f"{self.prefix}:dc:{dc}:snapshot"

    def fence(self, dc: str) -> str:
        return f"{self.prefix}:dc:{dc}:fence"

    def lease(self, dc: str) -> str:
        return f"{self.prefix}:dc:{dc}:lease"

    def summary(self, dc: str) -> str:
        """Stream of capacity summaries; writer: that DC's placer."""
        return f"{self.prefix}:dc:{dc}:summary"

    def thermal(self, dc: str) -> str:
        """Stream of thermal telemetry; writer: the thermal service."""
        return f"{self.prefix}:dc:{dc}:thermal"

    def readings(self, dc: str) -> str:
        """Stream of sensor readings (inlet/outlet per server and scan); writers: sensors, `hsched thermal replay`,
        the stack's emitter; reader: the thermal service's consumer group (hsched.thermal.published)."""
        return f"{self.prefix}:dc:{dc}:readings"

    def scans(self, dc: str) -> str:
        """Stream of complete scans assembled from the readings (the fit's window); writer: the thermal service."""
        return f"{self.prefix}:dc:{dc}:scans"

    def scans_applied(self, dc: str) -> str:
        """Sorted set of the scan ids already assembled (no scan counted twice); writer: the thermal service."""
        return f"{self.prefix}:dc:{dc}:scans:applied"

    def model(self, dc: str) -> str:
        """Hash {version, params, meta}: the room model's latest published version; writer: the thermal service."""
        return f"{self.prefix}:dc:{dc}:model"

    def model_versions(self, dc: str) -> str:
        """Stream of published model versions (placers follow it); writer: the thermal service."""
        return f"{self.prefix}:dc:{dc}:model:versions"

    @property
    def epoch(self) -> str:
        """The deployment's epoch marker (hsched.state.epoch); writer: `hsched up` or the first service, once."""
        return f"{self.prefix}:epoch"

    @property
    def tasks(self) -> str:
        """Stream of task lifecycle events; writers: the gateways (versions checked, see hsched.state.tasks)."""
        return f"{self.prefix}:tasks"

    def gateway(self, gateway_id: str) -> str:
        """A running gateway's lease (hsched.state.gateways); writer: that gateway."""
        return f"{self.prefix}:gateway:{gateway_id}"

    def job_owner(self, job_id: str) -> str:
        """The gateway id that advances DAG job `job_id` (hsched.state.gateways.GatewayLease.adopt); writers:
        that gateway, or one adopting the job once its owner's lease is gone."""
        return f"{self.prefix}:job-owner:{job_id}"

    def job_request(self, tenant: str, request_id: str) -> str:
        """The claim of a SubmitJob's (tenant, request_id) until its job is recorded; writer: that gateway."""
        return f"{self.prefix}:job-request:{len(tenant)}:{tenant}:{request_id}"

    def request(self, tenant: str, request_id: str) -> str:
        """The claim of a Submit's (tenant, request_id) while a gateway schedules it; writer: that gateway."""
        return f"{self.prefix}:request:{len(tenant)}:{tenant}:{request_id}"

    @property
    def links(self) -> str:
        """Stream of WAN link metric updates; writers: network probes / operators."""
        return f"{self.prefix}:links"

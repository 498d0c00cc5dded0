"""grpclib services, clients and lifecycle around the sans-I/O discovery plane.

Import the modules themselves (``kvcompass.services.maintenance_service`` and so on); this
package re-exports the gRPC layer's main names, loaded on first use, so importing one light
module of the package (``lifecycle``, ``wire``) does not pull in every server, aiohttp and
grpclib (a process's start-up time counts toward its recovery after a crash).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcompass.services.edge_service import EdgeServer, EdgeService, QueueBroadcaster
    from kvcompass.services.edge_sync import EdgeSync
    from kvcompass.services.ingest_client import IngestClient, SendReport
    from kvcompass.services.maintenance_service import MaintenanceConfig, MaintenanceServer, MaintenanceService, load_unit, serve_maintenance
    from kvcompass.services.metrics import MetricsServer, ServiceMetrics
    from kvcompass.services.status import error_from, grpc_error, status_of

_LAZY = {
    "EdgeServer": "edge_service",
    "EdgeService": "edge_service",
    "QueueBroadcaster": "edge_service",
    "EdgeSync": "edge_sync",
    "IngestClient": "ingest_client",
    "SendReport": "ingest_client",
    "MaintenanceConfig": "maintenance_service",
    "MaintenanceServer": "maintenance_service",
    "MaintenanceService": "maintenance_service",
    "load_unit": "maintenance_service",
    "serve_maintenance": "maintenance_service",
    "MetricsServer": "metrics",
    "ServiceMetrics": "metrics",
    "error_from": "status",
    "grpc_error": "status",
    "status_of": "status",
}

__all__ = [
    "EdgeServer",
    "EdgeService",
    "EdgeSync",
    "IngestClient",
    "MaintenanceConfig",
    "MaintenanceServer",
    "MaintenanceService",
    "MetricsServer",
    "QueueBroadcaster",
    "SendReport",
    "ServiceMetrics",
    "error_from",
    "grpc_error",
    "load_unit",
    "serve_maintenance",
    "status_of",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcompass.services' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"kvcompass.services.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

"""grpclib services, clients and lifecycle around the sans-I/O discovery plane.

Import the modules themselves (``kvcompass.services.maintenance_service`` and so on); this
package re-exports only the gRPC wire layer's main names.
"""

from __future__ import annotations

from kvcompass.services.edge_service import EdgeServer, EdgeService, QueueBroadcaster
from kvcompass.services.edge_sync import EdgeSync
from kvcompass.services.ingest_client import IngestClient, IngestRejected, SendReport
from kvcompass.services.maintenance_service import MaintenanceConfig, MaintenanceServer, MaintenanceService, load_unit, serve_maintenance
from kvcompass.services.metrics import MetricsServer, ServiceMetrics
from kvcompass.services.status import grpc_error, status_of

__all__ = [
    "EdgeServer",
    "EdgeService",
    "EdgeSync",
    "IngestClient",
    "IngestRejected",
    "MaintenanceConfig",
    "MaintenanceServer",
    "MaintenanceService",
    "MetricsServer",
    "QueueBroadcaster",
    "SendReport",
    "ServiceMetrics",
    "grpc_error",
    "load_unit",
    "serve_maintenance",
    "status_of",
]

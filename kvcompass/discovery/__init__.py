"""The discovery plane's logic, transport-free.

Plain objects over the Rust core with the time passed in (``now``, seconds): no sockets, no
sleeping, no wall clock, so the gRPC services and the simulator drive the very same code.
"""

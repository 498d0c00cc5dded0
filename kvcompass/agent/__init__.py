"""Engine adapters: turn a vLLM / SGLang engine's KV events into key ops for the index.

:mod:`kvcompass.agent.events` decodes (and encodes) the engines' ZMQ/msgpack wire format;
:mod:`kvcompass.agent.agent` holds :class:`WorkerAgent`, the sans-I/O state machine that keys
prefixes from token ids, tracks tiers and engine incarnations, and emits
:class:`~kvcompass.discovery.key_ops.KeyOpBatch` batches. Drivers start each agent process at
``incarnation=boot_incarnation(time.time_ns())`` (see :func:`boot_incarnation`) and answer a
unit's :class:`~kvcompass.errors.AgentSequenceError` with :meth:`WorkerAgent.on_rejected`.
"""

from __future__ import annotations

from kvcompass.agent.agent import TENANT_SALT_PREFIX, AgentOutput, AgentStats, ReplayRequest, WorkerAgent, boot_incarnation, medium_tier
from kvcompass.agent.events import (
    REPLAY_END_SEQ,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EngineBatch,
    Event,
    EventBatch,
    SkippedEvent,
    decode_message,
    decode_payload,
    decode_replay,
    encode_batch,
    encode_payload,
    encode_replay,
    encode_replay_end,
    encode_replay_request,
)

__all__ = [
    "REPLAY_END_SEQ",
    "TENANT_SALT_PREFIX",
    "AgentOutput",
    "AgentStats",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "EngineBatch",
    "Event",
    "EventBatch",
    "ReplayRequest",
    "SkippedEvent",
    "WorkerAgent",
    "boot_incarnation",
    "decode_message",
    "decode_payload",
    "decode_replay",
    "encode_batch",
    "encode_payload",
    "encode_replay",
    "encode_replay_end",
    "encode_replay_request",
    "medium_tier",
]

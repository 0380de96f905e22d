"""Transitional: the names `orchestrator/pool.py`'s old weight methods import. The transport lives in
`tandem.transport.weights`; delete this module with `InferencePool.load_policy/join_broadcast/follow_broadcast`."""

from tandem.transport.weights.control import JoinRequest, ReceiverStatus, Rendezvous
from tandem.transport.weights.control import WeightTransportError as WeightBroadcastError

__all__ = ["JoinRequest", "ReceiverStatus", "Rendezvous", "WeightBroadcastError"]

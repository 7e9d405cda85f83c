"""The wire: msgpack codec, message schema, ZeroMQ channels (stream, RPC, broadcast) and CURVE security.

``bus`` imports nothing else of Slipstream. The protocol is specified in docs/wire-protocol.md.
"""

from bus.address import bind_address, connectable, default_run_dir
from bus.broadcast import Publisher, Subscriber
from bus.codec import DEFAULT_LIMITS, DecodeError, DecodeLimits, decode, encode
from bus.rpc import RpcClient, RpcClosed, RpcServer, RpcTimeout
from bus.schema import SCHEMA_VERSION, Message, messages_equal
from bus.security import CurveKeyError, CurveKeys, Security, generate_cluster_keys
from bus.stream import StreamReceiver, StreamSender

__all__ = [
    "DEFAULT_LIMITS",
    "SCHEMA_VERSION",
    "CurveKeyError",
    "CurveKeys",
    "DecodeError",
    "DecodeLimits",
    "Message",
    "Publisher",
    "RpcClient",
    "RpcClosed",
    "RpcServer",
    "RpcTimeout",
    "Security",
    "StreamReceiver",
    "StreamSender",
    "Subscriber",
    "bind_address",
    "connectable",
    "decode",
    "default_run_dir",
    "encode",
    "generate_cluster_keys",
    "messages_equal",
]

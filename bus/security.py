"""Optional CURVE authentication and encryption for every bus socket.

The cluster shares one CURVE key pair, written once by ``tools/keygen.py DIR`` and distributed to every
node (like an SSH deploy key). Every binding socket (stream receiver, RPC server, publisher) is a CURVE
server with the cluster secret key; every connecting socket is a CURVE client that knows the cluster
public key. A ZAP authenticator on each context admits only clients whose public key is allowed: the
cluster key itself plus any extra keys given (a foreign actor with its own pair, say). A peer without the
key cannot complete the handshake, so nothing it sends is ever delivered, and all traffic is encrypted.

The authenticator is an asyncio task on the context's event loop, started the first time a server socket
of that context is configured; ``Security.close()`` stops it (do so before ``ctx.term()``, or use
``ctx.destroy()``).
"""

from __future__ import annotations

import asyncio
import os
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

PUBLIC_FILE = "cluster.key"
SECRET_FILE = "cluster.key_secret"


@dataclass(frozen=True)
class CurveKeys:
    """A CURVE key pair, Z85-encoded (40 bytes each)."""

    public: bytes
    secret: bytes = field(repr=False)

    @classmethod
    def generate(cls) -> CurveKeys:
        public, secret = zmq.curve_keypair()
        return cls(public=public, secret=secret)

    @classmethod
    def load(cls, directory: str | Path) -> CurveKeys:
        """Load the cluster pair written by ``tools/keygen.py DIR``."""
        directory = Path(directory)
        secret_path = directory / SECRET_FILE
        if not secret_path.is_file():
            raise FileNotFoundError(
                f"{secret_path}: no cluster secret key; create one with tools/keygen.py {directory}"
            )
        try:
            public, secret = zmq.auth.load_certificate(secret_path)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{secret_path}: not a valid CURVE certificate: {exc}") from exc
        if not secret:
            raise ValueError(f"{secret_path}: certificate has no secret-key")
        return cls(public=public, secret=secret)


def generate_cluster_keys(directory: str | Path, *, force: bool = False) -> CurveKeys:
    """Write a new cluster pair into ``directory`` (secret file mode 0600) and return it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name in (PUBLIC_FILE, SECRET_FILE):
        if (directory / name).exists() and not force:
            raise FileExistsError(f"{directory / name} exists; pass force=True (--force) to replace the cluster keys")
    public_path, secret_path = zmq.auth.create_certificates(directory, "cluster")
    os.chmod(secret_path, 0o600)
    os.chmod(public_path, 0o644)
    return CurveKeys.load(directory)


class _AllowedKeys:
    """ZAP credentials provider: a client is admitted iff its Z85 public key is in the set."""

    def __init__(self, keys: Iterable[bytes]) -> None:
        self.keys = set(keys)

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


# One authenticator per context: libzmq allows one ZAP handler (inproc://zeromq.zap.01) per context. Several
# Security objects on one context share it, and the keys any of them allows are admitted.
_AUTHENTICATORS: weakref.WeakKeyDictionary[zmq.Context, tuple[AsyncioAuthenticator, _AllowedKeys]] = (
    weakref.WeakKeyDictionary()
)


class Security:
    """Configures sockets as CURVE servers/clients of one cluster and runs the ZAP authenticator."""

    def __init__(
        self,
        cluster: CurveKeys,
        *,
        client: CurveKeys | None = None,
        allowed_clients: Iterable[bytes] = (),
    ) -> None:
        self.cluster = cluster
        self.client = client or cluster
        self.allowed_keys = frozenset([cluster.public, *allowed_clients])
        self._contexts: list[zmq.Context] = []

    @classmethod
    def from_directory(cls, directory: str | Path) -> Security:
        return cls(CurveKeys.load(directory))

    def apply_server(self, sock: zmq.Socket) -> None:
        """Make a binding socket a CURVE server; call before bind."""
        self._ensure_authenticator(sock.context)
        sock.curve_secretkey = self.cluster.secret
        sock.curve_publickey = self.cluster.public
        sock.curve_server = True

    def apply_client(self, sock: zmq.Socket) -> None:
        """Make a connecting socket a CURVE client of the cluster; call before connect."""
        sock.curve_secretkey = self.client.secret
        sock.curve_publickey = self.client.public
        sock.curve_serverkey = self.cluster.public

    def _ensure_authenticator(self, ctx: zmq.Context) -> None:
        existing = _AUTHENTICATORS.get(ctx)
        if existing is not None:
            existing[1].keys.update(self.allowed_keys)
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError("CURVE server sockets must be created inside a running asyncio event loop") from None
        auth = AsyncioAuthenticator(ctx)
        auth.start()
        allowed = _AllowedKeys(self.allowed_keys)
        auth.configure_curve_callback("*", allowed)
        _AUTHENTICATORS[ctx] = (auth, allowed)
        self._contexts.append(ctx)

    def close(self) -> None:
        """Stop the authenticators this object started."""
        for ctx in self._contexts:
            entry = _AUTHENTICATORS.pop(ctx, None)
            if entry is not None:
                entry[0].stop()
        self._contexts.clear()

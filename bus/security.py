"""Optional CURVE authentication and encryption for every bus socket.

The cluster shares one CURVE key pair, written once by ``python -m tools.keygen DIR`` and distributed to every
node (like an SSH deploy key). Every binding socket (stream receiver, RPC server, publisher) is a CURVE
server with the cluster secret key; every connecting socket is a CURVE client that knows the cluster
public key. A ZAP authenticator on each context admits only clients whose public key is allowed: the
cluster key itself plus any extra keys given (a foreign actor with its own pair, say). A peer without the
key cannot complete the handshake, so nothing it sends is ever delivered, and all traffic is encrypted.

The authenticator is an asyncio task on the context's event loop, started the first time a server socket
of that context is configured; ``Security.close()`` stops it (do so before ``ctx.term()``, or use
``ctx.destroy()``). It counts the handshakes it refuses (``Security.refused``) and logs a sample of them, so
a peer knocking with the wrong key is visible; a peer with no key at all fails the CURVE handshake before the
authenticator is asked, and is neither counted nor logged.

The secret key file is refused when group or others may read or write it (as ssh refuses a loose private key):
a key the whole machine can read authenticates nobody.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

PUBLIC_FILE = "cluster.key"
SECRET_FILE = "cluster.key_secret"

log = logging.getLogger(__name__)

# Log the first few refused handshakes of a context, then one in every LOG_EVERY: each connection a stranger opens
# costs one refusal (libzmq does not retry a refused one), and a flood of them must not flood the log.
# ``Security.refused`` holds the exact count.
LOG_FIRST = 5
LOG_EVERY = 1000

# libzmq applies a socket's MAXMSGSIZE to the CURVE handshake commands too (HELLO is 200 bytes; INITIATE ~250 plus
# the peer's metadata, routing id included, so up to ~560): a smaller limit refuses every CURVE peer, silently.
HANDSHAKE_FRAME_BYTES = 1024


class CurveKeyError(ValueError):
    """A key directory that cannot be used: a file missing, of the wrong kind, unreadable, or readable by others.

    The message names the file and says how to fix it; the launcher prints it as its one-line error.
    """


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
        """Load the cluster pair written by ``python -m tools.keygen DIR``; raises ``CurveKeyError`` naming the file.

        Checked before the secret is read: the directory holds both files (a node given only the public key
        cannot serve), the secret is a regular file that only its owner can read or write, and both files hold
        the same public key (a copy from two keygen runs would fail every handshake, with no clue why).
        """
        directory = Path(directory)
        if not directory.is_dir():
            raise CurveKeyError(f"{directory}: no such directory; create the cluster keys with "
                                f"tools/keygen.py {directory}")
        public_path, secret_path = directory / PUBLIC_FILE, directory / SECRET_FILE
        if not secret_path.exists():
            raise CurveKeyError(f"{secret_path}: no cluster secret key; create one with tools/keygen.py {directory}")
        _check_secret_file(secret_path)
        if not public_path.is_file():
            raise CurveKeyError(f"{public_path}: no cluster public key beside {SECRET_FILE}; copy both files "
                                f"written by tools/keygen.py")
        public, secret = _read_certificate(secret_path)
        if not secret:
            raise CurveKeyError(f"{secret_path}: certificate has no secret-key")
        if _read_certificate(public_path)[0] != public:
            raise CurveKeyError(f"{public_path}: public key does not match {secret_path}; copy both files from the "
                                f"same tools/keygen.py run")
        return cls(public=public, secret=secret)


def _check_secret_file(path: Path) -> None:
    """Refuse a secret key file that is not a regular file, or that group or others may read or write."""
    try:
        info = path.stat()  # follows a symlink (a mounted secret): the file's own mode is what protects it
    except OSError as error:
        raise CurveKeyError(f"{path}: cannot read the cluster secret key ({error.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise CurveKeyError(f"{path}: not a regular file ({_file_kind(info.st_mode)}); expected the cluster secret "
                            f"key written by tools/keygen.py")
    mode = stat.S_IMODE(info.st_mode)
    if os.name == "posix" and mode & 0o077:
        raise CurveKeyError(f"{path}: secret key file is accessible by group or others (mode {mode:04o}); "
                            f"fix with: chmod 600 {path}")


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "an unusual file type"


def _read_certificate(path: Path) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(path)
    except OSError as error:
        raise CurveKeyError(f"{path}: cannot read ({error.strerror})") from None
    except ValueError as error:
        raise CurveKeyError(f"{path}: not a valid CURVE certificate: {error}") from None


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
    """ZAP credentials provider: a client is admitted iff its Z85 public key is in the set; refusals are counted."""

    def __init__(self, keys: Iterable[bytes]) -> None:
        self.keys = set(keys)
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        self.refused += 1
        if self.refused <= LOG_FIRST or self.refused % LOG_EVERY == 0:
            log.warning("CURVE: refused a handshake from client key %s, which is not the cluster's (%d refused so "
                        "far)", key.decode("ascii", "replace"), self.refused)
        return False


def _fit_handshake(sock: zmq.Socket) -> None:
    """Raise a frame-size limit below ``HANDSHAKE_FRAME_BYTES`` to it, so the handshake can pass.

    A limit that small guards against strangers (the publisher's bound on subscriptions, say); under CURVE a stranger
    never gets past the handshake, and only key holders meet the looser bound.
    """
    if 0 <= sock.getsockopt(zmq.MAXMSGSIZE) < HANDSHAKE_FRAME_BYTES:
        sock.setsockopt(zmq.MAXMSGSIZE, HANDSHAKE_FRAME_BYTES)


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
        self._providers: list[_AllowedKeys] = []  # of every context this object configured a server socket on

    @classmethod
    def from_directory(cls, directory: str | Path) -> Security:
        return cls(CurveKeys.load(directory))

    @property
    def refused(self) -> int:
        """Handshakes refused so far because the client's key is not allowed, on the contexts whose server sockets
        this object configured (counted per context: objects sharing a context share its count)."""
        return sum(provider.refused for provider in self._providers)

    def apply_server(self, sock: zmq.Socket) -> None:
        """Make a binding socket a CURVE server; call before bind, after any MAXMSGSIZE (see ``_fit_handshake``)."""
        self._ensure_authenticator(sock.context)
        _fit_handshake(sock)
        sock.curve_secretkey = self.cluster.secret
        sock.curve_publickey = self.cluster.public
        sock.curve_server = True

    def apply_client(self, sock: zmq.Socket) -> None:
        """Make a connecting socket a CURVE client of the cluster; call before connect, after any MAXMSGSIZE."""
        _fit_handshake(sock)
        sock.curve_secretkey = self.client.secret
        sock.curve_publickey = self.client.public
        sock.curve_serverkey = self.cluster.public

    def _ensure_authenticator(self, ctx: zmq.Context) -> None:
        existing = _AUTHENTICATORS.get(ctx)
        if existing is not None:
            existing[1].keys.update(self.allowed_keys)
            if all(provider is not existing[1] for provider in self._providers):
                self._providers.append(existing[1])
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
        self._providers.append(allowed)

    def close(self) -> None:
        """Stop the authenticators this object started."""
        for ctx in self._contexts:
            entry = _AUTHENTICATORS.pop(ctx, None)
            if entry is not None:
                entry[0].stop()
        self._contexts.clear()

"""CURVE on every TCP socket: key files, the ZAP handler with folders of allowed keys, client keys.

Key files are pyzmq's certificate format (``NAME.key`` public, ``NAME.key_secret`` secret, mode
0600), made by ``rolloutd keygen``. A server socket allows exactly the public keys in its folder
(one folder per role: trainers, nodes); the folder is re-read when its contents change, so adding
or removing a key file needs no restart.

ZAP (the ZeroMQ authentication protocol) runs in pyzmq's ``ThreadAuthenticator``: handshakes never
wait on the daemon's event loop. A refused key is logged with the peer's address and public key.
A peer without CURVE never reaches ZAP (its handshake fails on the mechanism), so each server
socket is also watched for failed handshakes, which are logged as well. ``ZAP_ENFORCE_DOMAIN``
makes libzmq refuse a CURVE client when no handler answers, instead of letting it in.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from rolloutd.native_io.errors import ConfigError
from rolloutd.native_io.zmq_loop import SocketEvents
from rolloutd.native_io.zmq_sockets import make_socket

log = logging.getLogger(__name__)

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
ENV_SECRET_KEY_FILE = "ROLLOUTD_CURVE_SECRET_KEY_FILE"
"""A trainer's own secret key file (``rolloutd keygen``)."""
ENV_SERVER_KEY = "ROLLOUTD_CURVE_SERVER_KEY"
"""The public key file of the router (or node) the trainer connects to, or that key in Z85."""

HANDSHAKE_FAILURES = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                      | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


# --- key files ---------------------------------------------------------------------------------


def keygen(folder: Path, name: str) -> tuple[Path, Path]:
    """Write ``folder/name.key`` and ``folder/name.key_secret`` (0600); never overwrite a key."""
    if not name or "/" in name or name.startswith("."):
        raise ConfigError(f"key name {name!r} must be a plain file name")
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    public, secret = folder / f"{name}{PUBLIC_SUFFIX}", folder / f"{name}{SECRET_SUFFIX}"
    for path in (public, secret):
        if path.exists():
            raise ConfigError(f"{path} exists; remove it first or choose another name (keys are never overwritten)")
    old = os.umask(0o177)
    try:
        made_public, made_secret = zmq.auth.create_certificates(str(folder), name)
    finally:
        os.umask(old)
    os.chmod(made_secret, 0o600)
    os.chmod(made_public, 0o644)
    return Path(made_public), Path(made_secret)


def load_keypair(secret_key_file: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys from a ``.key_secret`` file."""
    try:
        public, secret = zmq.auth.load_certificate(os.fspath(secret_key_file))
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read CURVE key file {secret_key_file}: {e}; "
                          "create one with `rolloutd keygen`") from e
    if not secret:
        raise ConfigError(f"{secret_key_file} holds no secret key; give the .key_secret file made by `rolloutd keygen`")
    return public, secret


def load_public_key(key: str) -> bytes:
    """A Z85 public key, from a key file path or the 40-character key itself."""
    if len(key) == 40 and not os.path.exists(key):
        return key.encode()
    try:
        public, _ = zmq.auth.load_certificate(key)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read CURVE public key {key}: {e}") from e
    return public


def z85_of(raw_key: bytes) -> str:
    return z85.encode(raw_key).decode() if len(raw_key) == 32 else raw_key.decode(errors="replace")


# --- clients -------------------------------------------------------------------------------------


class CurveClient:
    """What a client socket needs to talk to a CURVE server; ``AsyncRolloutClient(curve=...)``."""

    def __init__(self, secret_key_file: str | os.PathLike[str], server_key: str) -> None:
        self.public, self.secret = load_keypair(secret_key_file)
        self.server = load_public_key(server_key)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "CurveClient":
        env = os.environ if environ is None else environ
        secret, server = env.get(ENV_SECRET_KEY_FILE), env.get(ENV_SERVER_KEY)
        if not secret or not server:
            raise ConfigError(
                f"a tcp:// address needs CURVE keys: set {ENV_SECRET_KEY_FILE} (your .key_secret file) and "
                f"{ENV_SERVER_KEY} (the server's .key file), or pass curve=CurveClient(...); "
                "rolloutd never talks over TCP unauthenticated"
            )
        return cls(secret, server)

    def apply_client(self, sock: zmq.Socket[Any]) -> None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)


# --- handshake failures ----------------------------------------------------------------------------


def watch_handshakes(sock: zmq.Socket[Any], on_failure: Callable[[str], None]) -> SocketEvents:
    """Calls ``on_failure(reason)`` for each failed handshake of ``sock``."""
    return SocketEvents(sock, HANDSHAKE_FAILURES, lambda event: on_failure(handshake_reason(event)))


def handshake_reason(event: dict[str, Any]) -> str:
    """Why a handshake failed, from its monitor event (one of HANDSHAKE_FAILURES)."""
    kind, value = event["event"], event["value"]
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        reason = f"the key was refused (ZAP status {value})"
    elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        reason = f"protocol error {zmq.Event(value).name} (a peer without CURVE keys, or a wrong server key)"
    else:
        reason = (f"handshake failed (errno {value}: {os.strerror(value)}; "
                  "a peer without CURVE keys, or a wrong server key)")
    return f"{reason} on {event['endpoint'].decode(errors='replace')}"


# --- servers ---------------------------------------------------------------------------------------


class _KeyFolderAuthenticator(ThreadAuthenticator):
    """ZAP with one folder of allowed public keys per domain, re-read when it changes; logs refusals."""

    def __init__(self, ctx: zmq.Context[Any]) -> None:
        super().__init__(ctx, log=logging.getLogger(f"{__name__}.zap"))
        self.folders: dict[str, Path] = {}
        self._stamps: dict[str, tuple[int, int]] = {}
        self._peer: tuple[str, str, bytes] = ("", "", b"")

    def allow_folder(self, domain: str, folder: Path) -> None:
        self.folders[domain] = folder
        self._reload(domain)

    def _reload(self, domain: str) -> None:
        folder = self.folders[domain]
        try:
            st = folder.stat()
        except OSError as e:
            log.error("allowed-keys folder %s is unreadable (%s): refusing every peer on %s", folder, e, domain)
            self.certs[domain] = {}
            return
        stamp = (st.st_mtime_ns, st.st_ino)
        if self._stamps.get(domain) != stamp:
            self._stamps[domain] = stamp
            self.configure_curve(domain=domain, location=str(folder))
            log.info("%d allowed key(s) for %s from %s", len(self.certs.get(domain, {})), domain, folder)

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if len(msg) >= 7:
            domain = msg[2].decode(errors="replace")
            self._peer = (domain, msg[3].decode(errors="replace"), msg[6])
            if domain in self.folders:
                self._reload(domain)
        await super().handle_zap_message(msg)

    def _send_zap_reply(self, request_id: bytes, status_code: bytes, status_text: bytes,
                        user_id: str = "anonymous") -> None:
        domain, address, key = self._peer
        if status_code != b"200":
            log.warning("refused %s peer %s: %s (public key %s); to allow it, put its .key file in %s",
                        domain or "a", address, status_text.decode(errors="replace"), z85_of(key),
                        self.folders.get(domain, "the allowed-keys folder"))
        else:
            log.debug("accepted %s peer %s (public key %s)", domain, address, z85_of(key))
        super()._send_zap_reply(request_id, status_code, status_text, user_id)


class CurveServer:
    """The ZAP handler of one ZeroMQ context and the CURVE server sockets it guards.

    Make it inside the running event loop (failed handshakes are read there); close it after its
    sockets and before the context is terminated.
    """

    def __init__(self, ctx: zmq.Context[Any], secret_key_file: str | os.PathLike[str]) -> None:
        self.ctx = ctx
        self.public, self.secret = load_keypair(secret_key_file)
        self.auth = _KeyFolderAuthenticator(ctx)
        self.auth.start()
        self.watches: list[SocketEvents] = []

    def bind_router(self, address: str, allowed_keys_dir: str | os.PathLike[str], domain: str,
                    on_disconnect: Callable[[], None] | None = None) -> zmq.Socket[Any]:
        """A ROUTER socket bound at ``address`` that lets in only the keys in ``allowed_keys_dir``.

        ``on_disconnect`` is called when a peer's connection closes (a socket has one monitor,
        so the caller cannot watch it separately).
        """
        if not address.startswith("tcp://"):
            raise ConfigError(f"CURVE servers listen on tcp:// addresses, got {address!r}")
        folder = Path(allowed_keys_dir)
        if not folder.is_dir():
            raise ConfigError(f"allowed-keys folder {folder} for {domain} does not exist; create it and put "
                              "the peers' .key files (from `rolloutd keygen`) there")
        self.auth.allow_folder(domain, folder)
        sock = make_socket(self.ctx, zmq.ROUTER, router_mandatory=True)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        # A peer that reconnects (same process, new connection) takes its routing id over.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        def on_event(event: dict[str, Any]) -> None:
            if event["event"] == zmq.EVENT_DISCONNECTED:
                if on_disconnect is not None:
                    on_disconnect()
            else:
                log.warning("refused a %s connection: %s", domain, handshake_reason(event))

        events = HANDSHAKE_FAILURES | (zmq.EVENT_DISCONNECTED if on_disconnect is not None else 0)
        watch = SocketEvents(sock, events, on_event)
        try:
            sock.bind(address)
        except zmq.ZMQError as e:
            watch.close()
            sock.close()
            raise ConfigError(f"cannot listen on {address}: {e}") from e
        self.watches.append(watch)
        log.info("listening for %s on %s (CURVE, keys in %s)", domain, address, folder)
        return sock

    def close(self) -> None:
        for watch in self.watches:
            watch.close()
        self.watches.clear()
        self.auth.stop()


def bind_curve_router(ctx: zmq.Context[Any], config: Any) -> tuple[zmq.Socket[Any], CurveServer]:
    """The node daemon's TCP socket for remote trainers (``NodeConfig.tcp_bind``) and its guard."""
    server = CurveServer(ctx, config.curve_secret_key_file)
    try:
        return server.bind_router(config.tcp_bind, config.curve_allowed_keys_dir, "trainers"), server
    except BaseException:
        server.close()
        raise

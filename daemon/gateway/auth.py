"""Who may call the gateway: the bearer token, the token inside the URL, trusted networks, and
where it listens.

The published server's clients send no ``Authorization`` header and post to the node's address
(``http://<node-ip>:8006``), so a gateway that insists on a bearer token on loopback refuses them.
Two ways let them in without opening the port to everyone:

- **the token in the URL**: ``http://rolloutd:<token>@<node-ip>:8006``. aiohttp and requests turn
  the URL's user and password into ``Authorization: Basic ...`` on every call, so the clients' own
  code sends the token once their base URL carries it (the user name is not checked);
- **trusted networks** (``--trusted-network CIDR``, repeatable, explicit): callers whose address
  lies in one of them need no token. Nothing is trusted unless the operator names it, and a
  network that holds every address (``/0``) is refused.

A bind address that is not loopback needs ``--allow-remote`` or a trusted network; the token file
must not be readable by group or others (``chmod 600``).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from rolloutd.native_io.errors import ConfigError

TOKEN_ENV = "ROLLOUTD_GATEWAY_TOKEN"
DEFAULT_BIND = "127.0.0.1:8006"
"""The published server's port, on loopback."""
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass
class Listen:
    host: str
    port: int

    @classmethod
    def parse(cls, bind: str, *, allow_remote: bool) -> Listen:
        host, sep, port = bind.rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"--bind {bind!r}: write HOST:PORT, e.g. {DEFAULT_BIND} (port 0 picks a free one)")
        if not allow_remote and not _is_loopback(host):
            raise ConfigError(f"--bind {bind!r} is not a loopback address: the gateway would take jobs from the "
                              "network over plain HTTP. Pass --allow-remote to mean it (callers then need the "
                              "token: 'Authorization: Bearer <token>' or http://rolloutd:<token>@HOST:PORT), or "
                              "--trusted-network CIDR for callers that send none")
        return cls(host, int(port))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_networks(specs: list[str]) -> list[Network]:
    """``--trusted-network`` values (``10.0.0.0/16``, ``192.168.1.7``, ``fd00::/8``)."""
    networks = []
    for spec in specs:
        try:
            net = ipaddress.ip_network(spec, strict=False)
        except ValueError as e:
            raise ConfigError(f"--trusted-network {spec!r}: write an address or a CIDR network, e.g. "
                              f"10.0.0.0/16 ({e})") from e
        if net.prefixlen == 0:
            raise ConfigError(f"--trusted-network {spec!r} holds every address: that is an open port, not a "
                              "trusted network; name the cluster's network (e.g. 10.0.0.0/16)")
        networks.append(net)
    return networks


def read_token(token_file: Path | None) -> str:
    """The token from ``--token-file`` (owner-only permissions) or ``$ROLLOUTD_GATEWAY_TOKEN``."""
    if token_file is not None:
        try:
            with open(token_file, encoding="utf-8") as f:
                mode = os.fstat(f.fileno()).st_mode
                if mode & (stat.S_IRWXG | stat.S_IRWXO):
                    raise ConfigError(f"the gateway token file {token_file} is open to group or others (mode "
                                      f"{stat.S_IMODE(mode):o}): anyone who reads it can submit jobs. Run "
                                      f"chmod 600 {token_file}")
                token = f.read().strip()
        except OSError as e:
            raise ConfigError(f"cannot read the gateway token from {token_file}: {e}") from e
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise ConfigError(f"the gateway needs a bearer token: --token-file FILE (non-empty) or ${TOKEN_ENV}")
    return token


@dataclass
class Access:
    """The token and the trusted networks; :meth:`refusal` says why a caller is refused, or None."""

    token: str
    trusted: list[Network] = field(default_factory=list)

    def refusal(self, authorization: str, peer: str | None) -> str | None:
        if self._trusted_peer(peer):
            return None
        scheme, _, credentials = authorization.partition(" ")
        if not authorization:
            return ("no token sent: send 'Authorization: Bearer <token>', or put the token in the gateway's URL "
                    "(http://rolloutd:<token>@HOST:PORT)")
        if scheme.lower() == "bearer":
            sent = credentials.strip()
        elif scheme.lower() == "basic":
            sent = _basic_password(credentials)
            if sent is None:
                return "the Basic credentials are not base64 of 'user:token'"
        else:
            return f"unsupported Authorization scheme {scheme!r}: use Bearer <token> or Basic (the token in the URL)"
        if not hmac.compare_digest(sent.encode(), self.token.encode()):
            return ("the token sent does not match the gateway's (--token-file or $ROLLOUTD_GATEWAY_TOKEN where "
                    "the gateway runs)")
        return None

    def _trusted_peer(self, peer: str | None) -> bool:
        if not self.trusted or not peer:
            return False
        try:
            address = ipaddress.ip_address(peer.partition("%")[0])
        except ValueError:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return any(address in net for net in self.trusted)


def _basic_password(credentials: str) -> str | None:
    try:
        decoded = base64.b64decode(credentials.strip(), validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    _, sep, password = decoded.partition(":")
    return password if sep else None

"""API keys and tenant cache namespaces.

With keys configured every ``/v1`` call (and the admin and tokenizer endpoints) needs
``Authorization: Bearer KEY``. With ``isolate_tenants`` the server derives the cache namespace from
the caller's key itself, so no client can pick another tenant's namespace and time its cache hits:

    final cache salt = "tenant:<HMAC-SHA256 of the key>|<client cache_salt or ''>"

A client salt that starts with ``public:`` is used as is by everyone, which shares a system prompt
across tenants on purpose. Tenant ids are a keyed hash of the key (never the key itself), stable
across restarts so several replicas with the same keys agree.

Admin keys (``--admin-key``) are accepted wherever an API key is (each is its own tenant) and are
the only keys that may act on every tenant: reset the prefix cache, read the KV event log (every
tenant's block keys), see and delete every tenant's pins. A tenant key asking for those gets a 403.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvreuse.server.errors import forbidden, unauthorized

PUBLIC_SALT_PREFIX = "public:"
TENANT_SALT_PREFIX = "tenant:"
# The HMAC key: a fixed label, so a tenant id is a function of the API key alone.
_TENANT_ID_LABEL = b"kvreuse tenant cache namespace v1"


@dataclass(frozen=True)
class Tenant:
    """The caller behind one API key; ``tenant_id`` is a keyed hash of that key."""

    tenant_id: str
    is_admin: bool = False


def tenant_id_of(api_key: str) -> str:
    return hmac.new(_TENANT_ID_LABEL, api_key.encode("utf-8"), hashlib.sha256).hexdigest()[:32]


def isolated_cache_salt(tenant_id: str, client_salt: str | None) -> str:
    """The salt of an isolated tenant's request (a ``public:`` client salt is kept as is)."""
    if client_salt is not None and client_salt.startswith(PUBLIC_SALT_PREFIX):
        return client_salt
    return f"{TENANT_SALT_PREFIX}{tenant_id}|{client_salt or ''}"


def bearer_key(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer KEY`` header, or None."""
    scheme, _, credentials = (authorization or "").strip().partition(" ")
    return credentials.strip() or None if scheme.lower() == "bearer" else None


def load_api_keys(keys: Iterable[str] | None = None, keys_file: str | Path | None = None,
                  what: str = "api_key") -> list[str]:
    """Keys from ``--api-key`` (repeatable) and ``--api-keys-file`` (one per line, ``#`` comments);
    ``what`` names the option in errors (``admin_key`` for the admin keys)."""
    collected = [key.strip() for key in (keys or [])]
    if keys_file is not None:
        try:
            lines = Path(keys_file).read_text(encoding="utf-8").splitlines()
        except OSError as error:
            raise ValueError(f"{what}s_file {str(keys_file)!r} cannot be read: {error.strerror}") from None
        collected += [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]
    for key in collected:
        if not key:
            raise ValueError(f"{what} must not be empty")
    return list(dict.fromkeys(collected))  # duplicates dropped, order kept


class ApiKeyAuth:
    """Checks bearer keys and turns (caller, client cache_salt) into the salt the engine gets."""

    def __init__(self, api_keys: Sequence[str] = (), isolate_tenants: bool = False,
                 admin_keys: Sequence[str] = ()) -> None:
        if isolate_tenants and not (api_keys or admin_keys):
            raise ValueError("isolate_tenants needs at least one api_key: tenants are told apart by their key")
        both = set(api_keys) & set(admin_keys)
        if both:
            raise ValueError(f"a key is given both as api_key and admin_key ({len(both)} key(s)): give it once")
        self.isolate_tenants = isolate_tenants
        self._keys = [(key.encode("utf-8"), Tenant(tenant_id_of(key))) for key in api_keys]
        self._keys += [(key.encode("utf-8"), Tenant(tenant_id_of(key), is_admin=True)) for key in admin_keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The tenant of an ``Authorization: Bearer KEY`` header; None when no keys are configured.
        Raises a 401 APIError for a missing or unknown key."""
        if not self._keys:
            return None
        if not authorization:
            raise unauthorized("missing API key: send 'Authorization: Bearer YOUR_KEY'")
        key = bearer_key(authorization)
        if key is None:
            raise unauthorized("malformed Authorization header: expected 'Bearer YOUR_KEY'")
        offered = key.encode("utf-8")
        found: Tenant | None = None
        # Compare with every key, in constant time each, so timing does not tell how close a guess was.
        for key, tenant in self._keys:
            if hmac.compare_digest(key, offered):
                found = tenant
        if found is None:
            raise unauthorized("invalid API key")
        return found

    def require_admin(self, tenant: Tenant | None, action: str) -> None:
        """403 unless the caller may act on every tenant: an admin key, or a server without keys."""
        if self._keys and (tenant is None or not tenant.is_admin):
            raise forbidden(f"{action} needs an admin key (--admin-key); this key is a tenant key")

    def cache_salt(self, tenant: Tenant | None, client_salt: str | None) -> str | None:
        """The salt of the request's cache namespace (see the module docstring)."""
        if self.isolate_tenants and tenant is not None:
            return isolated_cache_salt(tenant.tenant_id, client_salt)
        return client_salt

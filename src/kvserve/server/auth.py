"""API keys, tenants, and the per-tenant prefix-cache salt.

Why salts: a shared prefix cache is a timing side channel (CVE-2025-46570): a tenant who gets a
fast first token learns that someone else recently sent the same prefix. Salting every block hash
with the authenticated tenant makes tenants' caches disjoint in every tier. A client-supplied
cache_salt is folded into the tenant's salt, so it can split a tenant's cache further but can never
reach into another tenant's.
"""
from __future__ import annotations

import hashlib
import hmac
import json
from dataclasses import dataclass
from pathlib import Path

from kvserve.config import ConfigError
from kvserve.core.cache_retention import CacheRetention, CacheRetentionError, parse_cache_retention
from kvserve.server.protocol import APIError


@dataclass(frozen=True)
class ApiKey:
    key: str
    tenant: str | None  # None: the shared default tenant (keys given with --api-key)
    # The tenant's cache_retention for requests that give none (the JSON list form's "cache_retention")
    cache_retention: CacheRetention | None = None
    # May manage the tenant's pinned prefixes (/v1/cache/pins): --api-key keys, and file entries
    # with "admin": true
    admin: bool = False


def load_api_keys(keys: list[str] | None, keys_file: str | None) -> list[ApiKey]:
    """--api-key values (default tenant) plus --api-keys-file entries.

    File formats: a JSON object {"key": "tenant", ...}, a JSON list of {"key": ..., "tenant": ...,
    "cache_retention": {"priority": 80, "ttl_s": 600}, "admin": true} (the last two optional: the
    tenant's default retention; whether the key may pin prefixes), or text lines `KEY [TENANT]`
    (# comments, blank lines skipped). A key listed without a tenant in the file is its own tenant,
    so file keys never share a cache by accident. --api-key keys are admin keys.
    """
    result = [ApiKey(k, None, admin=True) for k in (keys or [])]
    for k in keys or []:
        if not k.strip():
            raise ConfigError("--api-key: an empty key would accept `Authorization: Bearer ` ; give a non-empty key")
    if keys_file:
        result.extend(_parse_keys_file(Path(keys_file)))
    seen: dict[str, str | None] = {}
    for k in result:
        if k.key in seen and seen[k.key] != k.tenant:
            raise ConfigError(f"--api-keys-file: key {k.key[:4]}... is mapped to two tenants "
                              f"({seen[k.key]!r} and {k.tenant!r}); give each key one tenant")
        seen[k.key] = k.tenant
    retention: dict[str | None, CacheRetention | None] = {}
    for k in result:
        if k.tenant in retention and retention[k.tenant] != k.cache_retention:
            raise ConfigError(f"--api-keys-file: tenant {k.tenant!r} has keys with different cache_retention "
                              f"({retention[k.tenant]} and {k.cache_retention}); give every key of a tenant the same")
        retention[k.tenant] = k.cache_retention
    return result


def _parse_keys_file(path: Path) -> list[ApiKey]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"--api-keys-file: cannot read {path}: {e.strerror}") from None
    stripped = text.lstrip()
    if stripped.startswith("{") or stripped.startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--api-keys-file {path}: invalid JSON at line {e.lineno}: {e.msg}") from None
        if isinstance(data, dict):
            items = list(data.items())
        else:
            items = []
            for i, entry in enumerate(data):
                if not isinstance(entry, dict) or not isinstance(entry.get("key"), str):
                    raise ConfigError(f"--api-keys-file {path}: entry {i} must be an object with a string \"key\" "
                                      "(and optionally \"tenant\")")
                try:
                    retention = parse_cache_retention(entry.get("cache_retention"), f"entry {i}: cache_retention")
                except CacheRetentionError as e:
                    raise ConfigError(f"--api-keys-file {path}: {e}") from None
                admin = entry.get("admin", False)
                if not isinstance(admin, bool):
                    raise ConfigError(f"--api-keys-file {path}: entry {i}: admin must be true or false, got {admin!r}")
                items.append((entry["key"], entry.get("tenant"), retention, admin))
        keys = []
        for key, tenant, *more in items:
            if not isinstance(key, str) or not key or not (tenant is None or isinstance(tenant, str)):
                raise ConfigError(f"--api-keys-file {path}: keys and tenants must be non-empty strings")
            retention, admin = more if more else (None, False)
            keys.append(ApiKey(key, tenant if tenant else key, retention, admin))
        return keys
    keys = []
    for lineno, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) > 2:
            raise ConfigError(f"--api-keys-file {path}:{lineno}: expected `KEY [TENANT]`, got {len(parts)} fields")
        keys.append(ApiKey(parts[0], parts[1] if len(parts) == 2 else parts[0]))
    if not keys:
        raise ConfigError(f"--api-keys-file {path}: no keys found")
    return keys


class Authenticator:
    def __init__(self, keys: list[ApiKey]):
        self._keys = [(k.key.encode(), k) for k in keys]
        self._retention = {k.tenant: k.cache_retention for k in keys if k.cache_retention is not None}

    def default_retention(self, tenant: str | None) -> CacheRetention | None:
        """The tenant's cache_retention for requests that give none (None: the server's default)."""
        return self._retention.get(tenant)

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def require(self, token: str | None) -> ApiKey:
        """The key for a bearer token, or the 401 that says how to send one."""
        key = self.authenticate(f"Bearer {token}" if token else None)
        if key is None:
            raise APIError("Missing or invalid API key: send `Authorization: Bearer <key>` with a key given to "
                           "--api-key or --api-keys-file", status=401, type="authentication_error",
                           code="invalid_api_key")
        return key

    def authenticate(self, authorization: str | None) -> ApiKey | None:
        """The key for an `Authorization: Bearer KEY` header, or None when it matches none."""
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        presented = token.strip().encode()
        found = None
        for raw, key in self._keys:  # compare against every key: no early exit to time
            if hmac.compare_digest(raw, presented):
                found = key
        return found


def effective_cache_salt(tenant: str | None, client_salt: str | None) -> str | None:
    """The salt handed to the engine: tenant salt combined with the client's, never replaced by it."""
    if tenant is None:
        return client_salt
    material = json.dumps(["kvserve-tenant", tenant, client_salt])  # unambiguous encoding of both
    return hashlib.sha256(material.encode()).hexdigest()

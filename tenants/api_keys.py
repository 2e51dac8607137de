"""The API key format `lp-<prefix>.<secret>` and its hashing.

The secret is 256 random bits, so a plain SHA-256 is enough (a slow password hash protects guessable
secrets, not random ones) and keeps authentication cheap on every request. Lookup is by prefix;
the hashes are compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

KEY_PREFIX = "lp-"
_PREFIX_BYTES = 6  # 12 hex characters (token_hex)
_SECRET_BYTES = 32


@dataclass(frozen=True)
class ParsedKey:
    prefix: str
    secret: str


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def generate_key() -> tuple[str, ParsedKey]:
    """A new key: (the full key to show once, its parts)."""
    prefix = secrets.token_hex(_PREFIX_BYTES)
    secret = secrets.token_urlsafe(_SECRET_BYTES)
    return f"{KEY_PREFIX}{prefix}.{secret}", ParsedKey(prefix=prefix, secret=secret)


def parse_key(raw: str) -> ParsedKey | None:
    """The parts of a presented key, or None when it does not have the `lp-<prefix>.<secret>` shape."""
    if not raw.startswith(KEY_PREFIX):
        return None
    prefix, dot, secret = raw[len(KEY_PREFIX):].partition(".")
    if not dot or not prefix or not secret or len(prefix) > 16:
        return None
    return ParsedKey(prefix=prefix, secret=secret)


def secret_matches(secret: str, secret_hash: str) -> bool:
    return hmac.compare_digest(hash_secret(secret), secret_hash)

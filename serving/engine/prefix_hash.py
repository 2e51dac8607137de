"""The keys of prefix caching: a hash per full block of a prompt, chained from the first block, so a
block's key names every token before it too.

A block's KV depends on the weights that computed it, so the chain starts from a seed naming them:
the base model's own seed, or an adapter's name and content digest. Requests of two adapters (or of
an adapter and the base) never share a block, and a name loaded again with other weights
(``load_inplace``) starts a new chain, so no request reads KV of the old weights. The name is in the
seed as well as the digest: adapter names are per tenant, so one tenant's prompts never hit another
tenant's blocks (a hit is faster, which would tell one tenant what the other sent). A request's
``cache_salt`` (vLLM's prompt field) is mixed into the seed too, so requests of one model that must
not share (two tenants on the base model) can be kept apart.

SHA-256 rather than Python's ``hash``: a key collision would hand one request another's KV, and
collisions of a fast non-cryptographic hash can be constructed by whoever writes prompts (vLLM made
the same choice after CVE-2025-25183).
"""

from __future__ import annotations

import hashlib
from array import array

BASE_SEED = hashlib.sha256(b"loraplex-prefix base").digest()


def adapter_seed(name: str, digest: str) -> bytes:
    """The seed of an adapter's blocks: its name and the digest of its content."""
    return hashlib.sha256(b"loraplex-prefix lora\0" + name.encode() + b"\0" + digest.encode()).digest()


def salted(seed: bytes, salt: str) -> bytes:
    """``seed`` mixed with a request's ``cache_salt`` (vLLM's): only requests of the same salt share."""
    return hashlib.sha256(b"loraplex-prefix salt\0" + seed + salt.encode()).digest()


def block_hashes(seed: bytes, token_ids: list[int], block_size: int) -> list[bytes]:
    """One key per full block of ``token_ids`` (a partial last block has none), each covering the
    block's tokens and, through the previous key, all before them."""
    keys: list[bytes] = []
    previous = seed
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        tokens = array("q", token_ids[start : start + block_size]).tobytes()
        previous = hashlib.sha256(previous + tokens).digest()
        keys.append(previous)
    return keys

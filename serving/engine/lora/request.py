"""Which adapter a request runs with, in vLLM's shape: ``LoRARequest(lora_name, lora_int_id,
lora_path)``. ``LoRARequest(name, path)`` is accepted too (a string second argument is the path).

The engine keys its caches by the adapter's content digest, never by this name or id: the name is
how callers refer to an adapter, the digest is what was loaded."""

from __future__ import annotations


class LoRARequest:
    """A named adapter and where to load it from (a local directory or ``s3://…``)."""

    __slots__ = ("lora_name", "lora_int_id", "lora_path")

    def __init__(
        self,
        lora_name: str,
        lora_int_id: int | str | None = None,
        lora_path: str | None = None,
    ) -> None:
        if isinstance(lora_int_id, str):
            if lora_path is not None:
                raise ValueError("LoRARequest takes (name, path) or (name, int_id, path), not two paths")
            lora_int_id, lora_path = None, lora_int_id
        if not isinstance(lora_name, str) or not lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {lora_name!r}")
        if lora_int_id is not None and (not isinstance(lora_int_id, int) or lora_int_id < 1):
            raise ValueError(f"lora_int_id must be a positive integer, got {lora_int_id!r}")
        if lora_path is not None and not isinstance(lora_path, str):
            lora_path = str(lora_path)
        self.lora_name = lora_name
        self.lora_int_id = lora_int_id
        self.lora_path = lora_path or None

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str | None:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoRARequest) and (self.lora_name, self.lora_path) == (other.lora_name, other.lora_path)

    def __hash__(self) -> int:
        return hash((self.lora_name, self.lora_path))

    def __repr__(self) -> str:
        return f"LoRARequest(lora_name={self.lora_name!r}, lora_int_id={self.lora_int_id!r}, lora_path={self.lora_path!r})"

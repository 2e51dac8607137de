"""The adapter side of the engine, laid out as vLLM's ``vllm/lora/``; the core (``llm_engine``,
``scheduler``, ``model_runner``, ``sequence``, ``config``) sits beside this package and uses it.

- ``request``: ``LoRARequest``, which adapter a request asks for (vLLM's shape).
- ``artifact``: the artifact contract (manifest.json, digests); standard library only, so the
  registry and training import it without torch.
- ``reader``: reads a PEFT adapter directory (local, ``file://`` or ``s3://``) into CPU tensors,
  validated against the base model; the registry's upload check uses its ``validate_adapter_dir``.
- ``records``: the records the parts below share: ``CachedAdapter`` (one content and where it is
  resident), ``AdapterHandle`` (a request's reference to it), ``PendingLoad`` and ``LoadResult``.
- ``loader``: ``AdapterLoader``, the reader run on loader threads, off the decode path.
- ``cpu_cache``: the CPU tier (``CPUCache``).
- ``gpu_slots``: the GPU tier, the ``max_loras`` preallocated slots (``SlotTable``).
- ``integrity``: the slots' checksums (``SlotChecksums``) and ``SlotCorruptedError``.
- ``cache``: ``LoRACache``, which ties the tiers together and is all the core talks to.

Imports run one way, top to bottom of the layers ``cache`` → ``loader`` | ``cpu_cache`` |
``gpu_slots`` → ``records`` → ``reader`` → ``artifact`` (import-linter holds it), and nothing here
imports the core. This file imports nothing: Django processes import ``artifact`` and ``reader``.
"""

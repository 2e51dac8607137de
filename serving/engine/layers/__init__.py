"""Model building blocks that read the per-step context: paged attention, multi-LoRA linear layers,
rotary embeddings and RMSNorm."""

"""Backend-free building blocks: units and shared constants, the integer ring state machine,
the attention-mask predicate, and the allocation rules of every cache class replayed on
integers. Nothing here imports MLX, PyTorch, or any other part of cachelib."""

"""cachelib: see inside KV caches. Profile, compare and plan cache strategies on real decodes."""

__version__ = "0.1.0"

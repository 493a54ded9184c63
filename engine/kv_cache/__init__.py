"""Paged KV cache: block bookkeeping and the K/V tensors."""

from engine.kv_cache.block_manager import BlockManager
from engine.kv_cache.cache import KVCache, bytes_per_block

__all__ = ["BlockManager", "KVCache", "bytes_per_block"]

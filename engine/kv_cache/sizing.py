"""How many KV blocks an engine gets: a fixed memory size on the CPU, vLLM's
``gpu_memory_utilization`` rule on a GPU."""

from __future__ import annotations

import torch

from engine.config import EngineConfig

# Device memory a GPU engine leaves out of its KV caches: the drafters' weights (copies of
# the target, draft models) and a step's activations.
GPU_HEADROOM_BYTES = 2 * 2**30


def kv_cache_blocks(config: EngineConfig, block_bytes: int, max_model_len: int) -> int:
    """The KV cache's size in blocks: ``memory_gib`` on the CPU. On a GPU, vLLM's rule, the
    share ``gpu_memory_utilization`` of the device's memory less what is allocated already
    (the model) and a headroom; half of that, since drafters keep caches as long as the
    target's for their own layers; and never more than every sequence at full length."""
    kv = config.kv_cache
    device = torch.device(config.device)
    if device.type != "cuda":
        return max(1, int(kv.memory_gib * 2**30) // block_bytes)
    total = torch.cuda.get_device_properties(device).total_memory
    allocated = torch.cuda.memory_allocated(device)
    budget = gpu_kv_cache_bytes(total, allocated, kv.gpu_memory_utilization)
    full = config.scheduler.max_num_seqs * -(-max_model_len // kv.block_size)
    return max(1, min(budget // 2 // block_bytes, full))


def gpu_kv_cache_bytes(total: int, allocated: int, utilization: float) -> int:
    """What a GPU engine may give its KV caches: the share ``utilization`` of ``total`` less
    what is ``allocated`` and ``GPU_HEADROOM_BYTES``."""
    budget = int(total * utilization) - allocated - GPU_HEADROOM_BYTES
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization {utilization} leaves no room for a KV cache: "
            f"{allocated / 2**30:.1f} GiB of the device's {total / 2**30:.1f} GiB are in use and "
            f"{GPU_HEADROOM_BYTES / 2**30:.0f} GiB are kept for drafters and activations"
        )
    return budget

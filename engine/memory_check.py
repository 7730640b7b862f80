"""Whether every slot's KV cache fits where the model runs, asked before the caches are made.

Without this a node sized past its GPU fails deep inside moshi's `streaming()` with a CUDA out-of-memory
traceback, after minutes of loading (seen on an H100, session 27: 64 slots beside the 2.6B STT's process,
which held 16 GB of the card). Asked first, the operator gets one line that says what was asked, what is
free, what else holds the device, and how many slots would fit.

The reserve beside the caches is measured, not derived: a full-size tick's peak GPU memory over weights
and KV was ~0.5 GB at batch 1 and ~1.8 GB at 64 (docs/benchmarks.md, section 1: activations, CUDA graphs'
pools, cuBLAS workspaces), so 0.5 GB and 25 MB a slot at the 7B's width (scaled by the model's). On CPU the
same check reads the host's available memory: a tiny model asked for a huge context would otherwise swap
the box to a halt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

RESERVE_BYTES = 500_000_000
RESERVE_BYTES_PER_SLOT = 25_000_000


class NotEnoughMemory(Exception):
    """The engine's slots cannot all have their KV caches on this device: an operator's sizing error, told
    in one line (kame-phone exits 2 on it, as on a bad checkpoint)."""


@dataclass(frozen=True)
class DeviceMemory:
    device: str
    free_bytes: int  # what this process can still allocate there, its allocator's unused cache counted
    total_bytes: int
    ours_bytes: int  # what this process holds there (the weights, by now)


def device_memory(device: torch.device) -> DeviceMemory | None:
    """What is free on `device`, or None where it cannot be read (then nothing is checked)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        # Ours: what is allocated; the allocator's unused cache is ours to use, so counted free.
        ours = torch.cuda.memory_allocated(device)
        return DeviceMemory(str(device), free + torch.cuda.memory_reserved(device) - ours, total, ours)
    if device.type == "cpu":
        info = _meminfo()
        if "MemAvailable" not in info or "MemTotal" not in info:
            return None  # not Linux, or an odd /proc
        return DeviceMemory("cpu", info["MemAvailable"], info["MemTotal"], 0)
    return None


def _meminfo() -> dict[str, int]:
    try:
        with open("/proc/meminfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        name, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            out[name] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return out


def reserve_bytes(device: str, slots: int, width: int) -> int:
    """Beside the caches: the tick's activations grow with the slots and the model's width (measured at
    4096, the 7B's), and a GPU also keeps cuBLAS workspaces and graph pools."""
    return _base_reserve(device) + _slot_reserve(width) * slots


def _base_reserve(device: str) -> int:
    return RESERVE_BYTES if device.startswith("cuda") else 0


def _slot_reserve(width: int) -> int:
    return RESERVE_BYTES_PER_SLOT * width // 4096


def slots_that_fit(memory: DeviceMemory, kv_bytes_per_slot: int, width: int) -> int:
    room = memory.free_bytes - _base_reserve(memory.device)
    return max(0, room // max(kv_bytes_per_slot + _slot_reserve(width), 1))


def check_slots_fit(memory: DeviceMemory, *, kv_cache_bytes: int, slots: int, width: int, kv_dtype: str,
                    context: int) -> None:
    """Raises NotEnoughMemory, saying how many slots would fit, when `slots` caches and the reserve do not."""
    reserve = reserve_bytes(memory.device, slots, width)
    need = kv_cache_bytes + reserve
    if need <= memory.free_bytes:
        return
    fit = slots_that_fit(memory, kv_cache_bytes // max(slots, 1), width)
    others = memory.total_bytes - memory.free_bytes - memory.ours_bytes
    held = (f"; other processes hold {others / 1e9:.1f} GB of it (an STT on the same GPU?)"
            if memory.device != "cpu" and others > 1e9 else "")
    hints = ["a lower --max-calls"] + (["--kv-dtype int8 (one byte a value)"] if kv_dtype == "auto" else []) + [
        "a shorter --context"]
    raise NotEnoughMemory(
        f"{slots} slots at context {context} frames need {kv_cache_bytes / 1e9:.1f} GB of KV cache ({kv_dtype}) "
        f"and ~{reserve / 1e9:.1f} GB for the tick, {need / 1e9:.1f} GB in all; {memory.device} "
        f"has {memory.free_bytes / 1e9:.1f} GB free of {memory.total_bytes / 1e9:.1f} GB after the weights{held}. "
        f"{fit} slots would fit: {', or '.join(hints)}")

"""The engine's adapters: loaded PEFT directories in host memory (LRU beyond --max-cpu-loras), the
--max-loras device slots a step's adapters must be in (LRU, loads counted), and each step's
rows grouped by slot for model/lora.py."""
from __future__ import annotations

import dataclasses
import logging
import os
from collections import Counter, OrderedDict
from collections.abc import Sequence

import torch

from kvserve.config import ModelConfig
from kvserve.core.lora import LoRARequest, adapter_key
from kvserve.core.step import ScheduledRequest, SchedulerOutput
from kvserve.model.lora import LoRAAdapter, LoRABatch, LoRASlots, LoRAStep, adapter_digest, load_adapter

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, cfg: ModelConfig, max_loras: int, max_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device: torch.device, orders: dict | None = None, kernels=None,
                 shard: tuple | None = None) -> None:
        """`orders` and `kernels`: LoRASlots' (the projections' epilogue orders; the kernels to pack for);
        `shard`: a tensor-parallel rank's (whole model config, rank, size), by which adapters are split."""
        self.cfg, self.max_rank, self.max_cpu_loras, self.dtype = cfg, max_rank, max_cpu_loras, dtype
        self.shard = shard
        self.slots = LoRASlots(cfg, max_loras, max_rank, dtype, device, orders, kernels)
        self.host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # key -> adapter, least recent first
        self.pins: Counter[str] = Counter()  # key -> unfinished requests using it
        self.slot_keys: list[str | None] = [None] * max_loras
        self._slot_order: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))
        self._digests: dict[str, tuple[tuple, str]] = {}  # path -> (stat, digest)
        self.num_slot_loads = 0  # adapters copied into a slot (swaps included)
        self.num_host_loads = 0  # adapters read from disk

    # -- host memory --------------------------------------------------------------------------------
    def _digest(self, path: str) -> str:
        """The adapter's content digest, recomputed only when its files change (size or mtime)."""
        from kvserve.model.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
        try:
            st = tuple((s.st_size, s.st_mtime_ns, s.st_ino) for s in
                       (os.stat(os.path.join(path, n)) for n in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)))
        except OSError:
            return ""  # load_adapter names the missing file
        cached = self._digests.get(path)
        if cached is None or cached[0] != st:
            cached = (st, adapter_digest(path))
            self._digests[path] = cached
        return cached[1]

    def resolve(self, req: LoRARequest, pins: int = 0) -> str:
        """The request's adapter key (core/lora.adapter_key), loading the adapter into host memory
        if it is not there, and held there for `pins` sequences (unpin each when it ends).
        Raises LoRAError for an adapter this engine cannot use."""
        digest = self._digest(req.lora_path)
        key = adapter_key(req.lora_name, digest)
        if key in self.host:
            self.host.move_to_end(key)
            self.pins[key] += pins
            return key
        adapter = load_adapter(req.lora_path, req.lora_name, self.cfg, self.max_rank, self.dtype, digest or None,
                               self.shard)
        key = adapter_key(req.lora_name, adapter.digest)
        self.num_host_loads += 1
        self.host[key] = adapter
        self.pins[key] += pins
        self._evict_host()
        logger.info("LoRA adapter %s loaded from %s: rank %d on %s, %.1f MiB (sha256 %s)", req.lora_name,
                    req.lora_path, adapter.rank, ",".join(adapter.targets), adapter.nbytes / 2**20,
                    adapter.digest[:12])
        return key

    def _evict_host(self) -> None:
        """Least recently used adapters no request holds, beyond --max-cpu-loras."""
        for key in list(self.host):
            if len(self.host) <= self.max_cpu_loras:
                return
            if not self.pins[key] and key not in self.slot_keys:
                del self.host[key]

    def unpin(self, key: str) -> None:
        self.pins[key] -= 1
        if self.pins[key] <= 0:
            del self.pins[key]
            self._evict_host()

    def in_use(self, name: str) -> int:
        """Unfinished requests using any adapter loaded under this name."""
        return sum(n for k, n in self.pins.items() if k.rpartition("@")[0] == name)

    # -- device slots -------------------------------------------------------------------------------
    def _slot_for(self, key: str, keep: set[str]) -> int:
        if key in self.slot_keys:
            slot = self.slot_keys.index(key)
        else:
            slot = next((s for s in self._slot_order if self.slot_keys[s] not in keep), None)
            if slot is None:
                raise RuntimeError(f"a step uses more adapters than --max-loras {len(self.slot_keys)} slots")
            self.slots.load(slot, self.host[key])
            self.slot_keys[slot] = key
            self.num_slot_loads += 1
        self._slot_order.move_to_end(slot)
        return slot

    def arrange(self, out: SchedulerOutput) -> tuple[SchedulerOutput, dict[str, int]]:
        """The step with its adapters in slots (loaded as needed) and its requests ordered by slot,
        base-model requests first, so that each adapter's rows are one contiguous segment."""
        keys = {s.request.lora_id for s in out.scheduled if s.request.lora_id is not None}
        if not keys:
            return out, {}
        slot_of = {k: self._slot_for(k, keys) for k in keys}
        order = sorted(out.scheduled, key=lambda s: -1 if s.request.lora_id is None else slot_of[s.request.lora_id])
        return dataclasses.replace(out, scheduled=order), slot_of

    def step(self, scheduled: Sequence[ScheduledRequest], query_start_loc: Sequence[int], slot_of: dict[str, int],
             device: torch.device) -> LoRAStep | None:
        """The step's rows with an adapter as segments of one slot each (after arrange())."""
        segments: list[tuple[int, int, int]] = []
        for i, s in enumerate(scheduled):
            if s.request.lora_id is None:
                continue
            slot, lo, hi = slot_of[s.request.lora_id], int(query_start_loc[i]), int(query_start_loc[i + 1])
            if segments and segments[-1][0] == slot:
                segments[-1] = (slot, segments[-1][1], hi)
            else:
                segments.append((slot, lo, hi))
        batch = LoRABatch.build(segments, self.slots.num_slots, device)
        return None if batch is None else LoRAStep(self.slots, batch)

    def active_adapters(self) -> list[str]:
        return [k for k in self.slot_keys if k is not None]

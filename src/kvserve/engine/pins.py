"""Pinned prefixes on the engine: computing them, the cap, and keeping them across restarts.

A pin is computed by an internal request (id "pin-<pin id>", one output token, no output sent):
when its prefill finishes, the step that freed its blocks pins them before anything else can be
allocated (kv/pins.py holds the references), so a pin never races an eviction. While that
request runs the pin is "pending"; the server polls until it is "pinned" (or "failed").

Cap (--max-pinned-kv-bytes, default half the KV pool): what pins hold, pending ones counted at
their full size, plus the new pin's blocks must fit; beyond it the pin is refused, the message
naming the cap, the pin's bytes and what is already pinned. Nor may pins leave less than one
sequence of max_model_len unpinned.

Restarts: with a disk tier (--kv-disk-path) the pins are recorded in pins.json in its directory
(written whole, then renamed) and pinned again when the engine starts, before it serves: their
blocks come back from the disk tier, where the shutdown's write-back put them, or are recomputed.
"""
from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass, field

from kvserve.core.kv_compression import NONE as NO_COMPRESSION
from kvserve.core.lora import LoRARequest
from kvserve.core.sampling_params import RequestOutputKind, SamplingParams
from kvserve.engine.outputs import RequestError

logger = logging.getLogger(__name__)

PINS_FILE = "pins.json"
REQUEST_PREFIX = "kvserve-pin:"
PENDING, PINNED, FAILED = "pending", "pinned", "failed"
_RESTORE_MAX_STEPS = 100_000  # a bound on the start-up loop; each pin's prefill takes a few steps


@dataclass
class PinRecord:
    id: str
    prompt_token_ids: list[int]
    cache_salt: str | None
    lora: dict | None = None  # {"name", "id", "path"} of the adapter its blocks are hashed with
    created: int = 0
    state: str = PENDING
    num_blocks: int = 0
    error: str | None = None
    _reserved: int = field(default=0, repr=False)  # blocks the cap counts while pending

    def view(self, block_size: int, bytes_per_block: int) -> dict:
        """What the API shows (never the salt)."""
        n = self.num_blocks if self.state == PINNED else self._reserved
        return {"id": self.id, "object": "cache.pin", "created": self.created, "status": self.state,
                "model": self.lora["name"] if self.lora else None, "num_tokens": len(self.prompt_token_ids),
                "num_blocks": n, "num_pinned_tokens": n * block_size, "bytes": n * bytes_per_block,
                **({"error": self.error} if self.error else {})}


class EnginePins:
    def __init__(self, engine, cap_bytes: int, bytes_per_block: int, directory: str | None) -> None:
        self.engine = engine
        self.cap_bytes = cap_bytes
        self.bytes_per_block = bytes_per_block
        self.block_size = engine.args.block_size
        self.path = os.path.join(directory, PINS_FILE) if directory else None
        self.records: dict[str, PinRecord] = {}

    # -- requests -------------------------------------------------------------------------------
    @staticmethod
    def is_internal(request_id: str) -> bool:
        return request_id.startswith(REQUEST_PREFIX)

    def add(self, prompt_token_ids: list[int], cache_salt: str | None, lora_request: LoRARequest | None,
            pin_id: str | None = None, created: int | None = None) -> dict:
        """Start pinning a prefix; its record as the API shows it (status "pending")."""
        if not self.engine.args.enable_prefix_caching:
            raise RequestError("pinning needs the prefix cache; start the server without "
                               "--no-enable-prefix-caching", "prompt")
        _, ids = self.engine._tokenize_prompt(list(prompt_token_ids))  # raises naming the prompt
        n = len(ids) // self.block_size
        if n == 0:
            raise RequestError(f"the prompt has {len(ids)} tokens; a pin holds whole KV blocks of "
                               f"{self.block_size} tokens (--block-size), so pin at least {self.block_size}",
                               "prompt")
        want = n * self.bytes_per_block
        held = self.held_bytes()
        if held + want > self.cap_bytes:
            raise RequestError(f"pinning this prompt takes {want} bytes ({n} KV blocks) but {held} bytes are already "
                               f"pinned and --max-pinned-kv-bytes is {self.cap_bytes}; unpin some "
                               f"(DELETE /v1/cache/pins/{{id}}), pin a shorter prefix or raise "
                               f"--max-pinned-kv-bytes", "max_pinned_kv_bytes")
        # What stays unpinned must still hold one sequence of max_model_len, or a long request
        # would wait for blocks forever.
        seq_blocks = -(-self.engine.max_model_len // self.block_size)
        room = self.engine.kv.pool.num_blocks - seq_blocks
        held_blocks = held // self.bytes_per_block
        if held_blocks + n > room:
            raise RequestError(f"pinning this prompt's {n} KV blocks would leave {self.engine.kv.pool.num_blocks - held_blocks - n} "
                               f"unpinned, fewer than the {seq_blocks} one sequence of --max-model-len "
                               f"{self.engine.max_model_len} needs ({held_blocks} already pinned of "
                               f"{self.engine.kv.pool.num_blocks}); unpin some, pin a shorter prefix, lower "
                               f"--max-model-len or give the KV cache more memory", "prompt")
        record = PinRecord(pin_id or f"pin-{uuid.uuid4().hex[:24]}", ids, cache_salt,
                           None if lora_request is None else
                           {"name": lora_request.lora_name, "id": lora_request.lora_int_id,
                            "path": lora_request.lora_path},
                           int(time.time()) if created is None else created, _reserved=n)
        # The whole prefix's exact KV, whatever the server's --kv-compression would release.
        params = SamplingParams(max_tokens=1, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY,
                                kv_compression=NO_COMPRESSION)
        self.engine.add_request(REQUEST_PREFIX + record.id, ids, params, cache_salt=cache_salt,
                                lora_request=lora_request)
        self.records[record.id] = record
        return record.view(self.block_size, self.bytes_per_block)

    def finished(self, req) -> None:
        """The step in which an internal request finished, before anything else is allocated."""
        record = self.records.get(req.request_id[len(REQUEST_PREFIX):])
        if record is None or record.state != PENDING:
            return
        if req.status.finish_reason == "abort":
            record.state, record.error = FAILED, "its prefill was aborted (a failed engine step); pin it again"
            return
        pin = self.engine.kv.pin(record.id, req)
        record.state, record.num_blocks = PINNED, len(pin.blocks)
        if len(pin.blocks) < record._reserved:
            logger.warning("pin %s: %d of its %d full blocks were in the cache to pin", record.id, len(pin.blocks),
                           record._reserved)
        self._save()

    # -- the API ----------------------------------------------------------------------------------
    def held_bytes(self) -> int:
        pending = sum(r._reserved for r in self.records.values() if r.state == PENDING)
        return (self.engine.kv.pins.num_blocks + pending) * self.bytes_per_block

    def get(self, pin_id: str, cache_salt: str | None) -> dict | None:
        record = self.records.get(pin_id)
        if record is None or record.cache_salt != cache_salt:
            return None  # another tenant's pin is not there for this one
        view = record.view(self.block_size, self.bytes_per_block)
        if record.state == FAILED:
            del self.records[pin_id]  # reported once
        return view

    def list(self, cache_salt: str | None) -> list[dict]:
        return [r.view(self.block_size, self.bytes_per_block) for r in self.records.values()
                if r.cache_salt == cache_salt and r.state != FAILED]

    def remove(self, pin_id: str, cache_salt: str | None) -> dict | None:
        record = self.records.get(pin_id)
        if record is None or record.cache_salt != cache_salt:
            return None
        view = record.view(self.block_size, self.bytes_per_block)
        if record.state == PENDING:
            self.engine.abort_request([REQUEST_PREFIX + pin_id])
        del self.records[pin_id]
        self.engine.kv.pins.unpin(pin_id)
        self._save()
        return view

    # -- across restarts ---------------------------------------------------------------------------
    def _save(self) -> None:
        if self.path is None:
            return
        keep = [asdict(r) for r in self.records.values() if r.state == PINNED]
        for r in keep:
            for k in ("state", "num_blocks", "error", "_reserved"):
                r.pop(k)
        tmp = self.path + ".tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"version": 1, "fingerprint": self._fingerprint(), "pins": keep}, f)
            os.replace(tmp, self.path)
        except OSError as e:
            logger.warning("cannot record the pinned prefixes in %s (%s); they will not be pinned after a "
                           "restart", self.path, e.strerror)

    def _fingerprint(self) -> str | None:
        fp = self.engine.setup.fingerprint
        return fp.hex if fp is not None else None

    def restore(self) -> None:
        """Pin again what the last run recorded, stepping the engine until every one is pinned."""
        if self.path is None or not os.path.exists(self.path):
            return
        try:
            with open(self.path, encoding="utf-8") as f:
                doc = json.load(f)
            saved = doc["pins"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("%s is unreadable (%s); the pins it recorded are dropped", self.path, e)
            return
        if doc.get("fingerprint") != self._fingerprint():
            # Token ids of another model (or KV format): nothing of theirs is in the disk tier either.
            logger.warning("%s records %d pins of another model or KV cache format; they are dropped", self.path,
                           len(saved))
            saved = []
        for p in saved:
            try:
                lora = p.get("lora")
                lora_request = LoRARequest(lora["name"], lora["id"], lora["path"]) if lora else None
                self.add(p["prompt_token_ids"], p.get("cache_salt"), lora_request, pin_id=p["id"],
                         created=p.get("created"))
            except Exception as e:  # a cap lowered since, an adapter gone: say so and go on
                logger.warning("pin %s from %s is not restored: %s", p.get("id"), self.path, e)
        steps = 0
        while any(r.state == PENDING for r in self.records.values()) and steps < _RESTORE_MAX_STEPS:
            self.engine.step()
            steps += 1
        pinned = [r for r in self.records.values() if r.state == PINNED]
        if pinned:
            logger.info("restored %d pinned prefixes (%d KV blocks) from %s", len(pinned),
                        sum(r.num_blocks for r in pinned), self.path)
        self._save()

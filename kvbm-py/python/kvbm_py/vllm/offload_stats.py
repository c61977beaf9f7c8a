"""kvbm's counters behind vLLM's offloading connector, in vLLM's own
offloading metrics: the spec declares them
(:func:`metric_definitions`, vLLM registers them with Prometheus as
``vllm:kvbm_offload_*``), and each step the manager hands vLLM what its
counters moved since the last step and the blocks each tier holds
(:class:`StatsDelta`), which vLLM logs and exports with its own."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
)

STORED = "vllm:kvbm_offload_stored_blocks"
LOADED = "vllm:kvbm_offload_loaded_blocks"
DEMOTED = "vllm:kvbm_offload_demoted_blocks"
SKIPPED = "vllm:kvbm_offload_skipped_blocks"
EVICTED = "vllm:kvbm_offload_evicted_blocks"
DAMAGED = "vllm:kvbm_offload_damaged_blocks"
RECOVERED = "vllm:kvbm_offload_recovered_blocks"
HELD = "vllm:kvbm_offload_held_blocks"


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """The metrics kvbm's manager reports, for vLLM to register."""
    counter, gauge = OffloadingCounterMetadata, OffloadingGaugeMetadata
    return {
        STORED: counter("Blocks kvbm stored in its host tier."),
        LOADED: counter("Blocks kvbm loaded into the engine, per tier they were read from.", ("tier",)),
        DEMOTED: counter("Blocks kvbm moved from its host tier to its disk tier."),
        SKIPPED: counter(
            "Blocks vLLM offered and kvbm did not store: refused by admission, or left out while every "
            "host slot was busy.",
            ("why",),
        ),
        EVICTED: counter("Blocks no tier of kvbm holds any more."),
        DAMAGED: counter("Blocks whose load failed (a copy or checksum failure): never loaded again."),
        RECOVERED: counter(
            "Blocks of the kept disk tier taken up at start, and those left out (torn records, not on every rank).",
            ("outcome",),
        ),
        HELD: gauge("Blocks kvbm holds loadable, per tier.", ("tier",)),
    }


def _counters(stats: Mapping[str, Any]) -> dict[tuple[str, tuple[str, ...]], int]:
    """Each counter's value in the manager's ``stats``."""
    g4 = int(stats.get("loaded_from_g4", 0))
    disk = int(stats["loaded_from_disk"])
    return {
        (STORED, ()): stats["stored"],
        (LOADED, ("G2",)): int(stats["loaded"]) - disk - g4,
        (LOADED, ("G3",)): disk,
        (LOADED, ("G4",)): g4,
        (DEMOTED, ()): stats["demoted"],
        (SKIPPED, ("refused",)): stats["refused"],
        (SKIPPED, ("full",)): stats["full"],
        (EVICTED, ()): stats["evicted"],
        (DAMAGED, ()): stats["damaged"],
        (RECOVERED, ("taken_up",)): stats["recovered"],
        (RECOVERED, ("left_out",)): stats["recovered_rejected"],
    }


class StatsDelta:
    """What the manager's counters moved since the last call, and the
    blocks each tier holds where that changed."""

    def __init__(self) -> None:
        self._counters: dict[tuple[str, tuple[str, ...]], int] = {}
        self._held: dict[str, int] = {}

    def take(self, stats: Mapping[str, Any], counts: Mapping[str, int]) -> OffloadingConnectorStats | None:
        """vLLM's stats of what moved (None when nothing did)."""
        out = OffloadingConnectorStats()
        for (name, labels), value in _counters(stats).items():
            moved = value - self._counters.get((name, labels), 0)
            if moved:
                out.increase_counter(name, moved, labels)
                self._counters[(name, labels)] = value
        for tier, held in (("G2", counts["ready"]), ("G3", counts["on_disk"])):
            if self._held.get(tier) != held:
                out.set_gauge(HELD, held, (tier,))
                self._held[tier] = held
        return None if out.is_empty() else out

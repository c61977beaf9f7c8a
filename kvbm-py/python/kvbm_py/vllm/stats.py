"""kvbm's numbers in vLLM's connector-stats and Prometheus plumbing.

The scheduler side hands vLLM, each step, what kvbm's counters moved since
the last step (:class:`KvbmStats`); vLLM sums those over its logging
interval, logs :meth:`KvbmStats.reduce` and feeds :class:`KvbmPromMetrics`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

#: Copy paths: (counter prefix in kvbm's stats, tier moved from/to).
PATHS = ("g1_to_g2", "g2_to_g3", "g1_to_g3", "g2_to_g1", "g3_to_g1")
#: Counters carried per interval (all sums).
COUNTERS = (
    ("lookup_blocks", "lookups"),
    ("hit_blocks_g2", "hits_g2"),
    ("hit_blocks_g3", "hits_g3"),
    ("onboard_failures", "onboard_failures"),
    ("offloads_skipped", "offloads_skipped"),
    ("verify_mismatches", "verify_mismatches"),
) + tuple((f"{p}_{what}", f"{p}_{what}") for p in PATHS for what in ("blocks", "bytes", "transfers", "seconds"))


def delta(now: Mapping[str, Any], before: Mapping[str, Any] | None) -> dict[str, float]:
    """What kvbm's counters (``Scheduler.stats()``) moved from ``before``
    to ``now``, under :class:`KvbmStats`'s keys."""
    before = before or {}
    return {key: now.get(src, 0) - before.get(src, 0) for key, src in COUNTERS}


@dataclass
class KvbmStats(KVConnectorStats):
    """kvbm's counters over an interval: blocks looked up and hit per tier
    (G2, G3), and blocks, bytes, copies and copy seconds per path. Every
    value is a sum, so aggregating is adding."""

    def __post_init__(self) -> None:
        for key, _ in COUNTERS:
            self.data.setdefault(key, 0)

    def reset(self) -> None:
        """Zeroes every counter."""
        self.data = {key: 0 for key, _ in COUNTERS}

    def aggregate(self, other: KVConnectorStats) -> KvbmStats:
        """Adds ``other``'s counters to these (``other`` another interval
        or another engine's)."""
        if other is not None and not other.is_empty():
            for key, value in other.data.items():
                self.data[key] = self.data.get(key, 0) + value
        return self

    def is_empty(self) -> bool:
        """Whether nothing moved: no lookup, no copy, no failure."""
        return not any(self.data.values())

    def reduce(self) -> dict[str, int | float]:
        """One line's worth: hit rates per tier (% of looked-up prompt
        blocks), MiB per path and the mean copy latency per path (ms)."""
        d = self.data
        out: dict[str, int | float] = {"lookup_blocks": d.get("lookup_blocks", 0)}
        lookups = d.get("lookup_blocks", 0)
        for tier in ("g2", "g3"):
            hits = d.get(f"hit_blocks_{tier}", 0)
            out[f"{tier}_hit_rate_%"] = round(100.0 * hits / lookups, 2) if lookups else 0.0
        for p in PATHS:
            n = d.get(f"{p}_transfers", 0)
            if not n:
                continue
            out[f"{p}_MiB"] = round(d.get(f"{p}_bytes", 0) / (1 << 20), 3)
            out[f"{p}_avg_ms"] = round(1e3 * d.get(f"{p}_seconds", 0.0) / n, 3)
        for key in ("onboard_failures", "verify_mismatches"):
            if d.get(key):
                out[key] = d[key]
        return out


class KvbmPromMetrics(KVConnectorPromMetrics):
    """kvbm's counters as vLLM Prometheus metrics (``vllm:kvbm_*``), per
    engine: prompt blocks looked up, blocks hit per tier, blocks, bytes
    and copy seconds per path, and blocks that failed their checksum."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def counter(name: str, doc: str, extra: str | None = None) -> Any:
            names = labelnames + ([extra] if extra else [])
            return self._counter_cls(name=name, documentation=doc, labelnames=names)

        self._lookups = counter("vllm:kvbm_lookup_blocks", "Prompt blocks kvbm looked up.")
        self._hits = counter("vllm:kvbm_hit_blocks", "Prompt blocks kvbm found, per tier.", "tier")
        self._blocks = counter("vllm:kvbm_blocks", "Blocks kvbm copied, per path.", "path")
        self._bytes = counter("vllm:kvbm_bytes", "Bytes kvbm copied, per path.", "path")
        self._seconds = counter("vllm:kvbm_transfer_seconds", "Seconds kvbm's copies took, per path.", "path")
        self._mismatches = counter(
            "vllm:kvbm_verify_mismatches",
            "Blocks whose bytes failed their checksum at load (verify mode); recomputed.",
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Adds one interval's :class:`KvbmStats` data to the metrics."""
        values = self.per_engine_labelvalues[engine_idx]
        d = transfer_stats_data
        self._lookups.labels(*values).inc(d.get("lookup_blocks", 0))
        for tier in ("g2", "g3"):
            self._hits.labels(*values, tier).inc(d.get(f"hit_blocks_{tier}", 0))
        for p in PATHS:
            self._blocks.labels(*values, p).inc(d.get(f"{p}_blocks", 0))
            self._bytes.labels(*values, p).inc(d.get(f"{p}_bytes", 0))
            self._seconds.labels(*values, p).inc(d.get(f"{p}_seconds", 0.0))
        self._mismatches.labels(*values).inc(d.get("verify_mismatches", 0))

"""What kvbm tells vLLM besides matches, through vLLM's real Scheduler: KV
events of its tiers, connector stats (vLLM's logging and Prometheus
plumbing), kvbm's own Prometheus exporter, and the per-request match state
the scheduler side keeps between steps."""

import socket
import time
import urllib.request

import pytest

from sched_harness import BLOCK, build

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PREFIX = list(range(300, 300 + 4 * BLOCK))  # 4 full blocks
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 64 * 2  # layers x K/V x tokens x heads x head x fp16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gone(h, rid):
    h.run_until(lambda: rid in h.finished and rid not in h.sched.requests)


def summed(stats) -> dict:
    out: dict = {}
    for s in stats:
        for k, v in (s.kv_connector_stats or {}).items():
            out[k] = out.get(k, 0) + v
    return out


def test_events_and_stats_follow_a_store_a_load_and_a_reset(tmp_path):
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as ext

    h = build(tmp_path, {"cpu_cache_gb": 0.01, "admission": "all"}, kv_events=True)
    try:
        a = h.request("A", PREFIX + [5], 1)
        gone(h, "A")
        h.step()
        stored = [e for e in h.events if isinstance(e, BlockStored) and e.medium == "CPU"]
        assert [e.block_hashes for e in stored] == [[ext(a.block_hashes[i])] for i in range(4)]
        assert [e.parent_block_hash for e in stored] == [None] + [ext(b) for b in a.block_hashes[:3]]
        assert [list(e.token_ids) for e in stored] == [PREFIX[i * BLOCK : (i + 1) * BLOCK] for i in range(4)]
        assert all(e.block_size == BLOCK for e in stored)
        s = summed(h.stats)
        assert s["g1_to_g2_blocks"] == 4, s
        assert s["g1_to_g2_bytes"] == 4 * BLOCK_BYTES, s
        assert s["g1_to_g2_transfers"] >= 1 and s["g1_to_g2_seconds"] > 0, s

        # Loaded back: a lookup of 4 blocks, all hits in G2.
        h.stats.clear()
        assert h.sched.reset_prefix_cache()
        h.request("C", PREFIX + [1, 2, 3], 2)
        gone(h, "C")
        s = summed(h.stats)
        assert (s["lookup_blocks"], s["hit_blocks_g2"], s["hit_blocks_g3"]) == (4, 4, 0), s
        assert s["g2_to_g1_blocks"] == 4 and s["g2_to_g1_bytes"] == 4 * BLOCK_BYTES, s

        # vLLM's own logging reduces the same data with kvbm's class.
        lines = []
        logging = KVConnectorLogging(h.vllm_config.kv_transfer_config)
        for st in h.stats:
            if st.kv_connector_stats:
                logging.observe(st.kv_connector_stats)
        logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
        assert lines and "g2_hit_rate_%=100.0" in lines[0], lines
        assert "g2_to_g1_avg_ms=" in lines[0], lines

        # Dropping G2 removes the blocks, and says so.
        h.events.clear()
        assert h.sched.reset_prefix_cache(reset_connector=True)
        want = sorted(ext(b) for b in a.block_hashes[:4])

        def removed():
            gone_blocks = [e for e in h.events if isinstance(e, BlockRemoved) and e.medium == "CPU"]
            return sorted(b for e in gone_blocks for b in e.block_hashes)

        # The events reach vLLM with a step's output; a loaded machine may
        # take a few steps.
        deadline = time.monotonic() + 30
        while removed() != want and time.monotonic() < deadline:
            h.step()
            time.sleep(0.01)
        assert removed() == want
    finally:
        h.close()


def test_stats_reach_vllm_prometheus_metrics(tmp_path):
    from prometheus_client import REGISTRY
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    from kvbm_py.vllm.stats import KvbmStats

    h = build(tmp_path, {"cpu_cache_gb": 0.01, "admission": "all"})
    try:
        prom = KVConnectorProm(h.vllm_config, ["model_name", "engine"], {0: ["tiny", "0"]})
        data = KvbmStats(data={"lookup_blocks": 8, "hit_blocks_g2": 6, "g2_to_g1_bytes": 4096})
        prom.observe(data.to_dict(), 0)
        labels = {"model_name": "tiny", "engine": "0"}
        assert REGISTRY.get_sample_value("vllm:kvbm_lookup_blocks_total", labels) == 8
        assert REGISTRY.get_sample_value("vllm:kvbm_hit_blocks_total", {**labels, "tier": "g2"}) == 6
        assert REGISTRY.get_sample_value("vllm:kvbm_bytes_total", {**labels, "path": "g2_to_g1"}) == 4096
        assert KvbmStats().is_empty() and not data.is_empty()
        assert data.aggregate(KvbmStats(data={"lookup_blocks": 2})).data["lookup_blocks"] == 10
    finally:
        h.close()


def test_metrics_port_serves_kvbm_metrics(tmp_path):
    port = free_port()
    h = build(tmp_path, {"cpu_cache_gb": 0.01, "admission": "all", "metrics_port": port})
    try:
        h.request("A", PREFIX + [7], 1)
        gone(h, "A")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        lines = [l for l in text.splitlines() if l.startswith("kvbm_offload_blocks_total")]
        assert any('path="g1_g2"' in l and float(l.split()[-1]) >= 4 for l in lines), text
    finally:
        h.close()


def test_a_waiting_request_sees_blocks_stored_after_its_first_match(tmp_path):
    h = build(tmp_path, {"cpu_cache_gb": 0.01, "admission": "all"})
    try:
        x = h.new_request("X", PREFIX + [9], 1)
        conn = h.connector
        # Asked again and again while nothing changes: the same answer,
        # from the keys and match kvbm kept.
        assert conn.get_num_new_matched_tokens(x, 0) == (0, False)
        assert conn.get_num_new_matched_tokens(x, 0) == (0, False)
        assert h.kvbm.tracked_requests() == 1
        # Another request stores the prefix: X's next call finds it.
        h.request("A", PREFIX + [5], 1)
        gone(h, "A")
        assert conn.get_num_new_matched_tokens(x, 0) == (4 * BLOCK, True)
        # vLLM's own prefix cache holds 2 blocks: kvbm offers the rest.
        assert conn.get_num_new_matched_tokens(x, 2 * BLOCK) == (2 * BLOCK, True)
        conn.request_finished(x, [])
        assert h.kvbm.tracked_requests() == 0
        assert h.kvbm.live_requests() == 0
    finally:
        h.close()


def test_the_spec_routes_counters_reach_vllm_offloading_metrics(tmp_path):
    """Behind vLLM's offloading connector kvbm's counters ride vLLM's own
    offloading stats: summed over the steps' stats they give what the
    manager counted, and vLLM's Prometheus plumbing exports them."""
    from prometheus_client import REGISTRY
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats

    two_slots = {"cpu_cache_gb": 2.5 * BLOCK_BYTES / 2**30, "admission": "all"}
    h = build(tmp_path, two_slots, connector="KvbmOffloadingConnector")
    try:
        manager = h.connector.connector_scheduler.manager
        h.request("A", PREFIX + [5], 1)
        h.run_until(lambda: h.idle() and manager.books.counts()["writing"] == 0)
        assert h.sched.reset_prefix_cache()
        h.request("B", PREFIX + [6], 1)
        gone(h, "B")
        h.step()
        total = OffloadingConnectorStats()
        for st in h.stats:
            if st.kv_connector_stats:
                total.aggregate(OffloadingConnectorStats(data=st.kv_connector_stats))
        got = total.reduce()
        m = manager.stats
        assert m["stored"] > 0 and m["loaded"] > 0, m
        counted = {
            "vllm:kvbm_offload_stored_blocks": m["stored"],
            "vllm:kvbm_offload_loaded_blocks:('G2',)": m["loaded"],
            "vllm:kvbm_offload_skipped_blocks:('full',)": m["full"],
            "vllm:kvbm_offload_evicted_blocks": m["evicted"],
        }
        assert {k: got.get(k, 0) for k in counted} == counted, got
        held = manager.books.counts()
        assert got["vllm:kvbm_offload_held_blocks:('G2',)"] == held["ready"], (got, held)
        # A step that moved nothing reports nothing of kvbm's.
        assert manager.get_stats() is None

        # vLLM's front end exports them; it made no connector, so its
        # configuration does not name kvbm's spec.
        h.vllm_config.kv_transfer_config.kv_connector_extra_config.pop("spec_name")
        prom = KVConnectorProm(h.vllm_config, ["model_name", "engine"], {0: ["tiny", "0"]})
        prom.observe(total.data, 0)
        labels = {"model_name": "tiny", "engine": "0"}
        assert REGISTRY.get_sample_value("vllm:kvbm_offload_stored_blocks_total", labels) == m["stored"]
        loaded = REGISTRY.get_sample_value("vllm:kvbm_offload_loaded_blocks_total", {**labels, "tier": "G2"})
        assert loaded == m["loaded"]
        g2 = REGISTRY.get_sample_value("vllm:kvbm_offload_held_blocks", {**labels, "tier": "G2"})
        assert g2 == held["ready"]
    finally:
        h.close()

"""vLLM's real v1 Scheduler with kvbm's connector and a fabricated model.

No weights and no attention kernels: the "model" writes, for every block a
step completes, a pattern derived from the block's hash into host KV
tensors registered with kvbm's worker-side connector, so every byte kvbm
moves can be checked. The worker-side connector is the one vLLM's own
bootstrap creates, driven through vLLM's model-runner mixin exactly as a
model runner drives it.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

BLOCK = 16
EOS = 2
LAYERS = 2
HEADS = 2
HEAD = 64

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": HEADS * HEAD * 2,
    "intermediate_size": 256,
    "num_attention_heads": HEADS * 2,
    "num_key_value_heads": HEADS,
    "num_hidden_layers": LAYERS,
    "vocab_size": 1024,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "torch_dtype": "float16",
    "bos_token_id": 1,
    "eos_token_id": EOS,
    "tie_word_embeddings": False,
}


def pattern(block_hash: bytes, layer: int) -> int:
    """The int16 value a block's bytes hold in `layer`."""
    return int.from_bytes(block_hash[:2], "little", signed=True) ^ (layer * 0x1111)


@dataclass
class Harness:
    sched: object
    vllm_config: object
    tensors: list
    hasher: object
    log: list = field(default_factory=list)
    #: Tokens each request had scheduled, summed over steps.
    scheduled: dict = field(default_factory=dict)
    #: Request ids vLLM reported finished.
    finished: list = field(default_factory=list)
    #: KV events kvbm's connector handed vLLM (with `kv_events`).
    events: list = field(default_factory=list)
    #: Scheduler stats of every step (`SchedulerStats`, or None).
    stats: list = field(default_factory=list)

    @property
    def connector(self):
        """kvbm's scheduler-role connector."""
        return self.sched.connector

    @property
    def kvbm(self):
        """The kvbm Scheduler object under the connector."""
        return self.sched.connector._scheduler.kvbm

    def new_request(self, req_id: str, prompt: list[int], max_tokens: int):
        """A vLLM Request with vLLM's block hashes, not yet scheduled."""
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sp.update_from_generation_config({}, EOS)
        return Request(
            request_id=req_id,
            prompt_token_ids=prompt,
            sampling_params=sp,
            pooling_params=None,
            block_hasher=self.hasher,
        )

    def request(self, req_id: str, prompt: list[int], max_tokens: int):
        """A new request added to vLLM's scheduler."""
        r = self.new_request(req_id, prompt, max_tokens)
        self.sched.add_request(r)
        return r

    def block_ids(self, req_id: str) -> list[int]:
        return list(self.sched.kv_cache_manager.get_block_ids(req_id)[0])

    def holds_pattern(self, block_id: int, block_hash: bytes) -> bool:
        for layer, t in enumerate(self.tensors):
            want = pattern(block_hash, layer)
            if not bool((t[block_id].view(torch.int16) == want).all()):
                return False
        return True

    def _compute(self, so) -> None:
        """The fabricated forward: write each block this step completes."""
        for rid, n in so.num_scheduled_tokens.items():
            self.scheduled[rid] = self.scheduled.get(rid, 0) + n
            r = self.sched.requests[rid]
            done = r.num_computed_tokens  # already advanced by schedule()
            first = (done - n) // BLOCK
            last = min(done // BLOCK, len(r.block_hashes))
            ids = self.block_ids(rid)
            for b in range(first, last):
                for layer, t in enumerate(self.tensors):
                    t[ids[b]].view(torch.int16).fill_(pattern(r.block_hashes[b], layer))

    def step(self) -> list[str]:
        """One engine step: schedule, run the connector hooks around the
        fabricated forward, update from the output."""
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.worker.kv_connector_model_runner_mixin import (
            KVConnectorModelRunnerMixin as Mixin,
        )

        so = self.sched.schedule()
        req_ids = list(so.num_scheduled_tokens)
        if so.total_num_scheduled_tokens == 0:
            kvo = Mixin.kv_connector_no_forward(so, self.vllm_config).kv_connector_output
        else:
            with set_forward_context(None, self.vllm_config):
                with Mixin.maybe_get_kv_connector_output(so) as kvo:
                    self._compute(so)
        sampled = []
        for rid in req_ids:
            r = self.sched.requests[rid]
            sampled.append([7] if r.num_computed_tokens >= r.num_tokens else [])
        mro = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=kvo,
        )
        out = self.sched.update_from_output(so, mro)
        for outs in out.values():
            if outs.scheduler_stats is not None:
                self.stats.append(outs.scheduler_stats)
        finished = [o.request_id for outs in out.values() for o in outs.outputs if o.finish_reason is not None]
        self.finished += finished
        self.log.append(
            f"scheduled={dict(so.num_scheduled_tokens)} finished={finished} "
            f"recv={sorted(kvo.finished_recving or []) if kvo else []} "
            f"sent={sorted(kvo.finished_sending or []) if kvo else []}"
        )
        return finished

    def run_until(self, done, timeout_s: float = 60.0, sleep_s: float = 0.005) -> None:
        """Steps until `done()` holds; fails after `timeout_s` seconds (a
        bound in time, not steps: a copy on a loaded machine can outlast
        hundreds of these steps), showing the last steps."""
        import time

        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError("condition not reached:\n" + "\n".join(self.log[-30:]))
            self.step()
            time.sleep(sleep_s)

    def idle(self) -> bool:
        return not self.sched.has_requests() and not self.sched.requests

    def close(self) -> None:
        from vllm.distributed.kv_transfer import kv_transfer_state

        self.connector.shutdown()
        kv_transfer_state._KV_CONNECTOR_AGENT = None


def build(
    tmp_path,
    extra: dict,
    num_blocks: int = 64,
    kv_events: bool = False,
    connector: str = "KvbmConnector",
    max_model_len: int = 1024,
    batched_tokens: int = 256,
    model_dir: str | None = None,
    sliding_window: int | None = None,
    heads_outer: bool = False,
) -> Harness:
    """vLLM's Scheduler and worker-side connector with kvbm's connector
    (`connector`: ``KvbmConnector`` or ``KvbmOffloadingConnector``)
    configured by `extra`, over host KV tensors of `num_blocks` blocks,
    for sequences of up to `max_model_len` tokens and `batched_tokens`
    tokens per step. With `kv_events`, vLLM publishes KV events (to its
    null publisher); the harness keeps those kvbm's connector gave in
    `events`. The model's configuration is written to `model_dir` (a new
    directory under `tmp_path` by default): harnesses given the same one
    run the same model, as engines sharing blocks do. With
    `sliding_window` (tokens), the second layer is a sliding-window layer
    of its own KV cache group, with vLLM's hybrid manager on. The KV
    tensors keep each block's K, then its V (``[blocks, 2, block size,
    heads * head size]``), or with `heads_outer` pack K and V per head
    (``[blocks, heads, block size, 2 * head size]``, as vLLM's CPU
    backend): the same shape here, read otherwise. The fabricated model's
    layers name a backend for each (``HARNESS_KV_SPLIT``,
    ``HARNESS_HEADS_PACKED``), where vLLM's own layers name theirs."""
    from unittest.mock import MagicMock, patch

    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        ensure_kv_transfer_initialized,
        get_kv_transfer_group,
    )
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
    from vllm.v1.structured_output import StructuredOutputManager

    if model_dir is None:
        model_dir = tempfile.mkdtemp(prefix="tiny-llama-config-", dir=tmp_path)
    config_file = os.path.join(model_dir, "config.json")
    if not os.path.exists(config_file):
        os.makedirs(model_dir, exist_ok=True)
        with open(config_file, "w") as f:
            json.dump(TINY_LLAMA, f)
    model_config = ModelConfig(
        model=model_dir,
        tokenizer=model_dir,
        skip_tokenizer_init=True,
        dtype="float16",
        seed=0,
        max_model_len=max_model_len,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=batched_tokens,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        disable_hybrid_kv_cache_manager=sliding_window is None,
    )
    cache_config = CacheConfig(
        block_size=BLOCK,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=True,
    )
    kv_transfer_config = KVTransferConfig(
        kv_connector=connector,
        kv_connector_module_path="kvbm_py.vllm" if connector == "KvbmConnector" else "kvbm_py.vllm.offload",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
        kv_load_failure_policy="recompute",
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=cache_config,
        kv_transfer_config=kv_transfer_config,
        device_config=DeviceConfig("cpu"),
        kv_events_config=(KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None),
    )
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float16)
    if sliding_window is None:
        groups = [KVCacheGroupSpec(layers, full)]
    else:
        window = SlidingWindowSpec(
            block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float16, sliding_window=sliding_window
        )
        groups = [KVCacheGroupSpec(layers[:1], full), KVCacheGroupSpec(layers[1:], window)]
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    vllm_config.cache_config.num_gpu_blocks = num_blocks

    # The worker first (vLLM's bootstrap, TP = 1), then its KV tensors
    # (CPU attention's 4-axis shape, blocks first), then the
    # scheduler, whose connector waits for the worker.
    tp = MagicMock()
    tp.broadcast_object.side_effect = lambda value, src=0: value
    with patch("vllm.distributed.parallel_state.get_tp_group", return_value=tp):
        ensure_kv_transfer_initialized(vllm_config, kv_cache_config)
    if heads_outer:
        tensors = [torch.zeros(num_blocks, HEADS, BLOCK, 2 * HEAD, dtype=torch.float16) for _ in layers]
    else:
        tensors = [torch.zeros(num_blocks, 2, BLOCK, HEADS * HEAD, dtype=torch.float16) for _ in layers]
    name = "HARNESS_HEADS_PACKED" if heads_outer else "HARNESS_KV_SPLIT"
    backend = SimpleNamespace(get_name=lambda: name)
    vllm_config.compilation_config.static_forward_context = {
        layer: SimpleNamespace(attn_backend=backend) for layer in layers
    }
    get_kv_transfer_group().register_kv_caches(dict(zip(layers, tensors)))
    sched = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
        log_stats=True,
    )
    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    h = Harness(
        sched=sched,
        vllm_config=vllm_config,
        tensors=tensors,
        hasher=get_request_block_hasher(BLOCK, hash_fn),
    )
    if kv_events:
        take = sched.connector.take_events

        def take_and_keep():
            events = list(take())
            h.events.extend(events)
            return events

        sched.connector.take_events = take_and_keep
    return h

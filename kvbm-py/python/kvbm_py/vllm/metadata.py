"""What the scheduler side tells the workers each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class KvbmMetadata(KVConnectorMetadata):
    """One step's news for every worker.

    kvbm's copies run on the workers but complete at the leader (in the
    scheduler process), so the scheduler side learns first what landed and
    hands it to the workers, which report it to vLLM the same step.
    """

    #: Requests whose asynchronous load finished (landed or failed).
    finished_recving: list[str] = field(default_factory=list)
    #: Finished requests whose offloads ran: vLLM may free their blocks.
    finished_sending: list[str] = field(default_factory=list)
    #: Engine block ids of failed loads: vLLM recomputes them.
    load_errors: list[int] = field(default_factory=list)
    #: Test hook: blocks to overwrite with zeros before the forward.
    corrupt_blocks: list[int] = field(default_factory=list)

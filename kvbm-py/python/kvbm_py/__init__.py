"""kvbm for Python: KV cache blocks beyond GPU memory.

Two objects, thin over kvbm's Rust crates:

* :class:`Scheduler` -- in the engine's scheduler process: a kvbm-dist
  leader and the tier engine (G2 host memory, G3 disk): match, onboard,
  offload, release, stats.
* :class:`Worker` -- in each engine worker process (one per tensor-parallel
  rank): the engine's KV tensors as kvbm's G1, executing the leader's copies.

The vLLM KV connector is :class:`kvbm_py.vllm.KvbmConnector` (importing
:mod:`kvbm_py` itself does not import vLLM). Configuration is
:class:`kvbm_py.config.KvbmConfig`; a worker is started with a
:class:`kvbm_py.config.WorkerConfig`, the scheduler side with a
:class:`kvbm_py.config.SchedulerConfig`.

Every error kvbm raises is a :class:`KvbmError`:

* :class:`InvalidArgumentError` (also a ``ValueError``) -- an argument or
  configuration value kvbm cannot use;
* :class:`TransferError` -- a copy between tiers failed;
* :class:`ClosedError` -- the object, or the peer it needs, was shut down;
* :class:`KvbmTimeoutError` (also a ``TimeoutError``) -- a peer did not
  answer in time.
"""

from kvbm_py._kvbm import (
    ClosedError,
    InvalidArgumentError,
    KvbmError,
    KvbmTimeoutError,
    Match,
    Scheduler,
    TransferError,
    Worker,
    __version__,
    sequence_hash,
    start_metrics_server,
)

__all__ = [
    "ClosedError",
    "InvalidArgumentError",
    "KvbmError",
    "KvbmTimeoutError",
    "Match",
    "Scheduler",
    "TransferError",
    "Worker",
    "__version__",
    "sequence_hash",
    "start_metrics_server",
]

"""Type stubs of kvbm_py's native module (built from the kvbm-py crate)."""

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, final, overload, type_check_only

from kvbm_py.config import SchedulerConfig, WorkerConfig

__all__ = [
    "KvbmError",
    "InvalidArgumentError",
    "TransferError",
    "ClosedError",
    "KvbmTimeoutError",
    "Scheduler",
    "Match",
    "Worker",
    "OffloadBooks",
    "OffloadKeys",
    "PageWorker",
    "sequence_hash",
    "inspect_g3",
    "kept_common",
    "start_metrics_server",
    "__version__",
    "TEST_HOOKS",
    "KEPT_ENTRY_BYTES",
]

__version__: str
#: Whether this build has the test hooks (feature ``test-hooks``).
TEST_HOOKS: bool
#: Bytes of one ``(slot, key)`` entry of a packed kept report (see
#: :func:`kept_common`).
KEPT_ENTRY_BYTES: int

@type_check_only
class _Tensor(Protocol):
    """A tensor kvbm reads through DLPack (a ``torch.Tensor``, or any
    object with ``__dlpack__`` whose capsule is an unversioned DLPack
    tensor on the host or a CUDA device)."""

    def __dlpack__(self) -> Any: ...

class KvbmError(Exception):
    """The base class of every error kvbm raises."""

class InvalidArgumentError(KvbmError, ValueError):
    """An argument or configuration value kvbm cannot use (also a
    ``ValueError``)."""

class TransferError(KvbmError):
    """A copy between the engine's memory and kvbm's tiers failed, or the
    memory for one could not be had."""

class ClosedError(KvbmError):
    """The object, or the peer it works with, was shut down."""

class KvbmTimeoutError(KvbmError, TimeoutError):
    """A peer did not answer in time (also a ``TimeoutError``)."""

def sequence_hash(digest: bytes) -> int:
    """The 64-bit key kvbm files an engine block hash under: the first 8
    bytes, little-endian (as kvbm-block's vLLM scheme keys a block).
    :class:`InvalidArgumentError` for fewer than 8 bytes."""

def inspect_g3(path: str, verify: bool = False) -> dict[str, Any]:
    """What the kept G3 directory ``path`` (one rank's) holds: ``identity``,
    ``slots``, ``blocks``, ``block_bytes``, ``disk_bytes``, ``bad_records``,
    and with ``verify`` (only while no engine has it open, ``in_use``)
    ``bad_blocks``: slots whose bytes fail their checksum."""

def kept_common(reports: Sequence[bytes]) -> tuple[bytes, int]:
    """The ``(slot, key)`` entries every one of ``reports`` names (each
    packed as :meth:`PageWorker.kept` gives them: 12 bytes an entry, the
    slot then the key, little-endian), packed in slot order, and how many
    distinct entries some report named but not every one."""

def start_metrics_server(port: int, host: str = "127.0.0.1") -> int:
    """Installs kvbm's Prometheus recorder in this process and serves the
    ``kvbm_*`` metrics over HTTP on ``host:port`` (0 picks a free port);
    returns the port served. Later calls return the same port."""

@final
class Match:
    """The outcome of :meth:`Scheduler.match_prefix`."""

    #: Leading blocks the engine already holds (as passed in).
    engine_blocks: int
    #: Blocks after those that kvbm holds in G2 (host memory).
    g2_blocks: int
    #: Blocks after those that kvbm holds in G3 (disk).
    g3_blocks: int
    #: Whether one block was given back so the engine computes the last
    #: prompt token.
    gave_back: bool
    #: Tokens kvbm can load: ``(g2_blocks + g3_blocks) * block_size``.
    external_tokens: int

@final
class Scheduler:
    """kvbm's scheduler-side object: a kvbm-dist leader plus the tier engine
    (G2 host memory, G3 disk) over the leader's distributed mover.

    Construct it after every worker was started, from a
    :class:`kvbm_py.config.SchedulerConfig`: it binds the config's
    endpoint, waits for its ``world_size`` workers (each proving it belongs
    to the instance with the secret published at ``secret_file``), sizes G2
    and G3 from the byte budgets and starts the tier engine. Requests are
    keyed by the engine's request id. A setting kvbm cannot use is an
    :class:`InvalidArgumentError`; a worker that does not come, a
    :class:`KvbmTimeoutError`.
    """

    def __new__(cls, config: SchedulerConfig) -> Scheduler: ...
    def save_history(self) -> bool:
        """Writes the use history beside the kept tiers now (it is written
        every second and at shutdown anyway); whether it wrote one."""
        ...
    @property
    def block_size(self) -> int:
        """Tokens per block."""
    @property
    def g3_staging_blocks(self) -> int:
        """G2 blocks set aside as the G3 prefetch's staging area (0: none)."""
    def staging_free_blocks(self) -> int:
        """Staging blocks free now (the others hold G3 blocks read for
        matched requests)."""
    def capacity(self) -> dict[str, int]:
        """Blocks per worker in each tier: ``{"g1": .., "g2": .., "g3": ..}``."""
    def ranks(self) -> list[str]:
        """Each rank's state as the leader sees it: ``"live"``,
        ``"rejoining"`` or ``"lost: <why>"``. While a rank is not live,
        copies fail (and are reported so); a lost rank's G2 and G3 bytes
        are gone."""
    def match_prefix(self, request_id: str, hashes: Sequence[bytes], prompt_tokens: int, engine_blocks: int) -> Match:
        """Matches the request's block hashes (one per full block, in prompt
        order) beyond the ``engine_blocks`` the engine holds, in G2 then G3.
        When everything would hit, one block is given back so the engine
        computes the last token. Found blocks are held until
        :meth:`onboard` or :meth:`release`.

        Calls for the same request convert only the hashes not seen before
        and give the previous answer, without matching again, while the
        arguments are the same and nothing was stored into G2/G3 since;
        :meth:`release` forgets the request."""
    def tracked_requests(self) -> int:
        """Requests whose keys are kept (matched, not released)."""
    def onboard(self, request_id: str, block_ids: Sequence[int]) -> None:
        """Starts copying the matched blocks into the engine's block ids
        (one per matched block, in prefix order)."""
    def poll_onboards(self) -> tuple[list[str], list[tuple[str, KvbmError]]]:
        """Onboards finished since the last poll: ``(loaded, failed)``, the
        failed ones with the exception they failed with (a
        :class:`TransferError`, or a :class:`ClosedError` once shut down).
        A failed onboard counts nothing as loaded."""
    def wait_onboard(self, request_id: str) -> None:
        """Waits for the request's onboard: returns when every block
        landed, raises what it failed with (a :class:`TransferError`)
        otherwise. :class:`InvalidArgumentError` for a request without an
        onboard in progress."""
    def offload(
        self,
        request_id: str,
        block_ids: Sequence[int],
        hashes: Sequence[bytes],
        parent: bytes | None = None,
    ) -> None:
        """Queues the engine's full blocks (consecutive along the prompt,
        ``parent`` the hash of the block before the first) for offload to
        G2. Their bytes must stay unchanged until the request is released."""
    def release(self, request_id: str, retention: float | str | None = None) -> bool:
        """Forgets the request: cancels offloads not started, waits for
        running copies and any onboard into its blocks. ``False`` if
        unknown. ``retention`` (seconds until a follow-up, or ``"done"``)
        is a hint for the request's matched blocks."""
    def release_after_offloads(self, request_id: str, retention: float | str | None = None) -> None:
        """Lets the queued offloads run, then releases, on a thread; the id
        then shows in :meth:`poll_released`. ``retention`` as in
        :meth:`release`."""
    def poll_released(self) -> list[str]:
        """Request ids whose deferred release finished since the last poll."""
    def flush(self) -> None:
        """Waits until every queued offload was processed."""
    def live_requests(self) -> int:
        """Requests kvbm knows (matched and not released)."""
    def subscribe_events(self) -> None:
        """Starts collecting the tiers' KV events for :meth:`take_events`."""
    def take_events(self) -> list[tuple[bool, str, int, int | None]]:
        """KV events since the last call: ``(stored, tier, key, parent)``,
        ``stored`` ``False`` for a removal, ``tier`` ``"g2"`` or ``"g3"``,
        ``key``/``parent`` kvbm keys (see :func:`sequence_hash`)."""
    def stats(self) -> dict[str, Any]:
        """Counters: blocks, bytes, copies (``_transfers``) and copy seconds
        (``_seconds``) per path (``g1_to_g2``, ``g2_to_g3``, ``g2_to_g1``,
        ``g3_to_g1``, ``g1_to_g3``), skipped offloads, onboard failures,
        matches, hits per tier, queue depth, blocks held per tier,
        ``verify_mismatches``: blocks that failed their checksum (0 unless
        ``verify``), and ``copy_failures_by``: failed blocks by
        ``"path/cause"`` (a dict). The others are ints and floats."""
    def reset(self) -> int:
        """Drops every G2/G3 block no request holds, and keeps nothing
        stored from now on in tiers kept across restarts (the engine's
        weights may change after a reset); returns how many."""
    def shutdown(self) -> None:
        """Stops the tier engine and tells every worker to exit."""

@final
class Worker:
    """kvbm's worker-side object for one rank: the engine's KV tensors as
    G1 (no copy), G2 host memory and G3 disk, executing the leader's
    copies on a thread of its own.

    ``config`` says where the leader is and what this rank keeps (see
    :class:`kvbm_py.config.WorkerConfig`). ``tensors`` holds one tensor per
    attention layer, in layer order: torch tensors (any object with
    ``__dlpack__``), all on the host or all on one CUDA device, whose
    address, shape, strides, element size and device kvbm reads itself
    and which it keeps alive as long as it may touch their memory.
    ``num_blocks`` names the block axis. Shapes: flash-attn ``[2, blocks,
    block_size, heads, head]``, FlashInfer ``[blocks, 2, block_size, heads,
    head]``, CPU attention ``[blocks, 2, block_size, inner]``, MLA
    ``[blocks, block_size, latent]``; anything else, or strides kvbm cannot
    address exactly, is an :class:`InvalidArgumentError` here.
    """

    def __new__(cls, config: WorkerConfig, tensors: Sequence[_Tensor], num_blocks: int) -> Worker: ...
    @property
    def rank(self) -> int:
        """This worker's rank."""
    @property
    def num_blocks(self) -> int:
        """G1 blocks (the engine's)."""
    @property
    def block_bytes(self) -> int:
        """Bytes of one block on this rank (all layers, K and V)."""
    def is_running(self) -> bool:
        """Whether the worker still runs."""
    def exception(self) -> KvbmError | None:
        """The error the worker stopped on; ``None`` while it runs or when
        it stopped cleanly."""
    def join(self, timeout_s: float = 10.0) -> bool:
        """Waits for the worker to stop; ``True`` if it stopped."""

@final
class OffloadKeys:
    """A request's offload keys of one KV cache group, standing in for
    vLLM's list of them: extended from the request's block hashes in one
    call, a slice of it a view of the same keys, each key a ``bytes``
    object (the block hash, then the group as 4 big-endian bytes) only
    once it is read. ``OffloadBooks``' lookups read a view's keys without
    making them."""

    def __new__(cls, group: int) -> OffloadKeys: ...
    def extend_hashes(self, hashes: list[bytes], start: int, step: int) -> None:
        """Appends the keys of ``hashes[start::step]``. A list only, not a
        slice; :class:`InvalidArgumentError` for a ``step`` of 0 or a hash
        shorter than 8 bytes."""
    def append(self, key: bytes) -> None:
        """Appends ``key`` to a slice (the list grows from block hashes
        only: :class:`InvalidArgumentError`)."""
    def __len__(self) -> int: ...
    @overload
    def __getitem__(self, index: int, /) -> bytes: ...
    @overload
    def __getitem__(self, index: slice, /) -> OffloadKeys | list[bytes]: ...
    def __iter__(self) -> Iterator[bytes]: ...
    def __eq__(self, other: object, /) -> bool: ...

@final
class OffloadBooks:
    """The scheduler's books of the host tier behind vLLM's offloading
    connector, and of a disk tier of ``disk_slots`` behind it (none when
    0): which (block, KV cache group) key each of ``slots`` slots holds,
    ranked and admitted by ``admission`` (``"all"``, ``"reuse_score"`` or
    ``"min_uses:N"``). Keys are vLLM's offload keys (block hash, then the
    group as 4 big-endian bytes). A slot handed out by :meth:`reserve` is
    loadable only after :meth:`commit`, and a pinned block is not evicted
    until :meth:`unpin`. A block the host tier evicts moves to disk with
    the store that takes its slot (the tiers hold disjoint blocks)."""

    def __new__(cls, slots: int, admission: str = "reuse_score", disk_slots: int = 0) -> OffloadBooks: ...
    @property
    def slots(self) -> int:
        """Slots in the host tier."""
    @property
    def disk_slots(self) -> int:
        """Slots in the disk tier (0 without one)."""
    @staticmethod
    def key(key: bytes) -> int:
        """kvbm's 64-bit key of an offload key."""
    def lookup(self, key: bytes) -> int:
        """``0`` not held, ``1`` store in flight, ``2`` loadable."""
    def lookup_fn(self, hit: Any, miss: Any) -> Callable[[bytes, Any], Any]:
        """A callable ``(offload key, request context) -> hit or miss`` for
        vLLM's per-key lookup (``hit`` where the key is loadable); notes
        the key as asked for by ``request context.req_id``."""
    def lookup_prefix(self, keys: list[bytes] | OffloadKeys, req: str) -> int:
        """How many of ``keys``, from the first, are loadable (vLLM's
        prefix lookup in one call); the keys it asks, up to the first miss,
        are noted as asked for by ``req``."""
    def lookup_window(self, keys: list[bytes] | OffloadKeys, req: str, window: int, first_window: int) -> int:
        """vLLM's sliding-window lookup in one call: scanning ``keys`` from
        the last, the end (exclusive) of the first run of ``window``
        loadable keys (``first_window`` for a run ending at the last key);
        without one, how many keys at the start are loadable. The keys
        scanned are noted as asked for by ``req``."""
    def note(self, req: str, keys: Sequence[bytes]) -> None:
        """Notes ``keys`` as asked for by request ``req``."""
    def record(self, req: str) -> None:
        """Records in the use history what ``req`` asked for since the
        last call."""
    def finish(self, req: str, hint: float | str | None = None) -> None:
        """Records what finished request ``req`` asked for and forgets it;
        its keys get the retention ``hint`` (seconds until a follow-up, or
        ``"done"``), if any."""
    def reserve(
        self, keys: Sequence[bytes], chained: bool = True, fetched: bool = False
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]], list[int], int, int, list[tuple[int, int]]]:
        """``(index into keys, slot)`` per key to write, ``(kvbm key, host
        slot, disk slot)`` per block to move to disk before those slots
        are written (loadable from disk once the store is confirmed), the
        kvbm keys no tier holds any more, and how many were refused by
        admission or left out while every slot was busy, and ``(kvbm key,
        host slot)`` per block that left the host tier for these slots (its
        bytes stay there until the slot is written). With ``fetched``
        the keys are blocks a load brings in from G4: admission is not
        asked."""
    def restore_host(self, blocks: bytes) -> list[int]:
        """Takes up the blocks a host tier kept across a restart holds, as
        :meth:`restore_disk` (entries as :meth:`PageWorker.kept_host` gives
        them). Call it before :meth:`restore_disk`: a key both tiers hold
        is served from the host tier."""
    def restore_disk(self, blocks: bytes) -> list[int]:
        """Takes up the blocks a disk tier kept across a restart holds,
        ``(disk slot, kvbm key)`` entries packed as :meth:`PageWorker.kept`
        gives them: they are loadable from their slots. Returns the keys
        taken up (not a slot or key listed twice, nor a slot beyond the
        tier). Call it before the first store."""
    def keep_history(self, path: str) -> int:
        """Keeps the use history in the file ``path`` beside a kept disk
        tier: takes up what it holds (call it before :meth:`restore_disk`,
        so the kept blocks rank by their past uses), then writes it every
        second on a thread and once more at :meth:`close_history`. Returns
        the blocks the file remembered."""
    def close_history(self) -> None:
        """Writes the use history a last time and stops its thread."""
    def commit(self, keys: Sequence[bytes], ok: bool) -> None:
        """Confirms (``ok``) or abandons the stores of ``keys``."""
    def pin(self, keys: Sequence[bytes]) -> list[tuple[bool, int]]:
        """Pins ``keys`` for one load and returns ``(on disk, slot)`` for
        each; :class:`InvalidArgumentError` if any is not loadable."""
    def unpin(self, keys: Sequence[bytes]) -> None:
        """Ends one load of each of ``keys``."""
    def touch(self, keys: Sequence[bytes]) -> None:
        """Marks ``keys`` as just used."""
    def reset(self) -> int:
        """Drops every block no load or store uses; returns how many."""
    def clear(self) -> int:
        """Forgets every store and load in flight and drops every block."""
    def doom(self, keys: Sequence[bytes]) -> None:
        """Marks ``keys`` as damaged: never loaded again."""
    def counts(self) -> dict[str, int]:
        """``{"ready", "writing", "reading", "on_disk", "demoting"}`` slot
        counts."""
    def take_events(self) -> list[tuple[bool, bool, int]]:
        """``(on disk, stored, kvbm key)`` since the last call."""

@final
class PageWorker:
    """One rank's host tier behind vLLM's offloading connector: the
    engine's page tensors per KV cache group (``groups``: per group one
    tensor per layer and the page bytes; each tensor a ``(num_blocks,
    bytes)`` view of the layer, its rows one block stride apart, whose
    memory spans every row's stride; torch tensors or any object with
    ``__dlpack__``, kept alive by kvbm, all on the host or all on one CUDA
    device) and ``slots`` host slots of ``slot_bytes`` (pinned near that
    device, system memory for host tensors), and with ``disk_dir`` a disk
    tier of ``disk_slots`` slots in a file of its own there; with
    ``disk_kept`` (an identity) that tier is kept across restarts in
    ``disk_dir`` (see :meth:`kept`). With ``verify`` every stored slot's
    checksum is recorded and checked after each load of it. With
    ``sum_tail`` each slot has room for a checksum after its block, which
    G4 moves with the block, salted with ``tail_salt`` (engines that lay a
    block out otherwise take other salts, so one never takes another's
    block for its own). With ``host_kept`` (``(directory, identity)``,
    the directory in a memory-backed file system) the host slots are kept
    across restarts there (see :meth:`kept_host`)."""

    def __new__(
        cls,
        groups: Sequence[tuple[Sequence[_Tensor], int]],
        num_blocks: int,
        slots: int,
        slot_bytes: int,
        verify: bool = False,
        disk_dir: str | None = None,
        disk_slots: int = 0,
        sum_tail: bool = False,
        disk_kept: str | None = None,
        host_kept: tuple[str, str] | None = None,
        tail_salt: int = 0,
    ) -> PageWorker: ...
    @property
    def slots(self) -> int:
        """Slots in the host tier."""
    def kept(self) -> tuple[str, bytes, int, str | None] | None:
        """What the kept disk tier held when the worker opened it:
        ``(directory, (disk slot, kvbm key) entries packed (see
        :func:`kept_common`), torn or damaged records, why it started
        afresh or None)``; None without a kept disk tier."""
    def kept_host(self) -> tuple[str, bytes, int, str | None] | None:
        """What the kept host tier held when the worker opened it, as
        :meth:`kept` says of the disk tier (``(host slot, kvbm key)``
        entries); None without a kept host tier."""
    def stop_keeping(self) -> None:
        """Empties every record of the kept tiers and records nothing in
        them from now on (the engine's cache was reset: what it computes
        next may come from other weights than a restarted engine loads):
        stores submitted before record nothing, and the disk tier's
        records go after the moves submitted before; a no-op without a
        kept tier."""
    def store(
        self,
        job: int,
        copies: Sequence[tuple[int, int, int]],
        demote: Sequence[tuple[int, int, int, int]] = ...,
        keys: Sequence[int] | None = None,
    ) -> None:
        """Starts copying ``(group, engine block, host slot)`` pages into
        host slots, after moving ``demote``'s ``(host slot, disk slot,
        group, kvbm key)`` blocks to disk. ``keys`` (one kvbm key per copy)
        names the blocks in a kept host tier's records."""
    def unrecord(self, slots: Sequence[int]) -> None:
        """Empties the kept host tier's records of ``slots`` before a block
        from G4 is written into them; a no-op without a kept host tier."""
    def load(
        self,
        job: int,
        copies: Sequence[tuple[int, int, int]],
        disk_copies: Sequence[tuple[int, int, int]] = ...,
    ) -> None:
        """Starts copying host slots into ``(group, engine block, host
        slot)`` pages and disk slots into ``disk_copies``' pages."""
    def slot_memory(self) -> tuple[int, int]:
        """``(address, bytes)`` of the host slots, for a G4 client to
        register."""
    @property
    def slot_stride(self) -> int:
        """Bytes from one host slot to the next."""
    def block_bytes(self, group: int) -> int:
        """Bytes of one block of KV cache group ``group``."""
    def seal(self, group: int, slots: Sequence[int]) -> list[bool]:
        """Writes the checksum of the block of ``group`` in each of
        ``slots`` right after it (needs ``sum_tail``); per slot whether it
        was sealed: not one whose bytes changed since they were stored
        (verify mode)."""
    def move_to_disk(self, moves: Sequence[tuple[int, int, int, int]]) -> None:
        """Moves ``(host slot, disk slot, group, kvbm key)`` blocks to disk
        and waits."""
    def adopt(self, group: int, slots: Sequence[int]) -> list[bool]:
        """Per slot of ``slots`` holding a block of ``group`` that arrived
        from G4 with its checksum after it: whether its bytes match."""
    def assembly_memory(self, bytes: int) -> tuple[int, int]:
        """``(address, bytes)`` of host memory that shards published by an
        engine of another parallelism are read into (made on the first
        call)."""
    def assemble(
        self,
        group: int,
        slots: Sequence[int],
        shard_count: int,
        shard_bytes: int,
        pieces: Sequence[tuple[int, int, int]],
    ) -> list[bool]:
        """Per slot of ``slots``: whether its block of ``group`` was
        assembled from its bundle of shards in the assembly memory (each
        checked against its checksum, then ``(src, dst, bytes)`` pieces
        copied and the slot sealed)."""
    def finished(
        self,
    ) -> list[tuple[int, bool, int, float, list[tuple[int, int]], TransferError | None]]:
        """Jobs ended since the last call: ``(job, ok, bytes, seconds,
        failed (group, block) pairs, the error the job failed with)``."""
    def wait(self, jobs: Sequence[int]) -> None:
        """Waits until none of ``jobs`` is in flight."""
    def corrupt_slot(self, slot: int) -> None:
        """Test hook (feature ``test-hooks``): changes every byte of host
        slot ``slot``."""
    def corrupt_disk_slot(self, slot: int) -> None:
        """Test hook (feature ``test-hooks``): overwrites disk slot
        ``slot`` with zeros."""

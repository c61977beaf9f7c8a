"""How G4 names the pieces of a block so that engines of any tensor-parallel
size share them.

A rank holds its share of each block: with tensor parallelism the pages
of a KV cache group are split by KV heads, or replicated (MLA's latent
cache, or more ranks than heads). vLLM relates every rank's page to a
*canonical* page of the whole block, the same under any parallelism
(``CanonicalPageMapping``). Where vLLM can do that for every layer of a
group, kvbm publishes that group's blocks as *shards*: the split of the
canonical page into ``s`` shares (``s`` = the number of distinct shares
the engine's ranks hold), each named ``c{s}.{h}`` and published once by
a rank holding share ``h``, its bytes those of that rank's pages. An
engine of the same split reads its own shards straight into its slots;
an engine of another split reads the shards that hold its share into
assembly memory, checks each against its checksum, and copies its share
out of them (``PagedWorker.assemble``), following the *layouts* the
writers published beside their shards: per layer, how a rank's page
lies in the canonical page.

A group vLLM cannot relate to a canonical page (Mamba state, a layout it
does not recognise, context parallelism) keeps one part per rank, named
after the engine's parallelism and the rank: only engines of the same
parallelism share it.

The shard count of each group is worked out where vLLM's KV cache specs
are known (``KvbmOffloadingConnector``, in the scheduler and in every
rank) and reaches kvbm's spec in its extra config under
:data:`SHARDS_KEY`; each rank checks it against vLLM's mappings of its
pages before it publishes or reads a shard.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: The extra-config key carrying :func:`shards_of`'s answer to the spec.
SHARDS_KEY = "kvbm_g4_shards"

#: One fragment of a page: ``(offset in the rank's page, offset in the
#: canonical page, bytes)``.
Fragment = tuple[int, int, int]


def shards_of(vllm_config: Any, kv_cache_config: Any) -> dict[int, dict[str, Any] | None]:
    """Per KV cache group (by vLLM's group id), None when vLLM cannot relate
    its pages to a canonical page, else: ``shards``, how many shares its
    canonical page splits into at this parallelism; ``splits``, every
    split an engine of another tensor-parallel size may have published
    it in; ``page``, the canonical page's bytes per layer. Mirrors the
    checks vLLM's mappings make (each rank checks its mappings too)."""
    from vllm.v1.kv_cache_interface import (
        AttentionSpec,
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        iter_layer_specs,
    )

    p = vllm_config.parallel_config
    tp = p.tensor_parallel_size
    heads = vllm_config.model_config.get_total_num_kv_heads()
    plain = p.world_size == tp and p.decode_context_parallel_size == 1 and p.prefill_context_parallel_size == 1
    by_heads = [d for d in range(1, heads + 1) if heads % d == 0]

    def split(spec: Any) -> tuple[int, tuple[int, ...], int] | None:
        if not isinstance(spec, AttentionSpec) or spec.kv_quant_mode.is_per_token_head:
            return None
        page = spec.real_page_size_bytes
        if type(spec) is MLAAttentionSpec:
            # The latent cache is the same at every rank: one share.
            return (1, (1,), page) if spec.tokens_per_state == 1 and page % spec.block_size == 0 else None
        if isinstance(spec, MLAAttentionSpec) or not isinstance(spec, (FullAttentionSpec, SlidingWindowSpec)):
            return None
        if (heads % tp and tp % heads) or spec.num_kv_heads != max(1, heads // tp):
            return None
        s = min(tp, heads)
        return s, tuple(by_heads), s * page

    out: dict[int, dict[str, Any] | None] = {}
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        found = {split(spec) for spec in iter_layer_specs(group.kv_cache_spec)} if plain else {None}
        one = found.pop() if len(found) == 1 else None
        out[gid] = None if one is None else {"shards": one[0], "splits": list(one[1]), "page": one[2]}
    return out


def _parallel_name(config: Any, rank: int) -> str:
    p = config.parallel
    return f"w{p.world_size}t{p.tp_size}p{p.pp_size}c{p.pcp_size}d{p.dcp_size}.r{rank}"


def shard_name(shards: int, share: int) -> str:
    """The part of a block holding share ``share`` of ``shards``."""
    return f"c{shards}.{share}"


@dataclass(frozen=True)
class G4Parts:
    """The names of each block's parts in G4, per offloaded group (by its
    position among vLLM's offloaded groups), for one rank."""

    #: Shards of each group's canonical page at this parallelism (None:
    #: the group is published per rank).
    shards: tuple[int | None, ...]
    #: The parts an engine of this parallelism publishes of a block: all
    #: of them must be in G4 for a block to be read from it.
    own: tuple[tuple[str, ...], ...]
    #: This rank's part: what it reads, and what it publishes when
    #: ``publishes`` says so (a rank holding a share another rank holds
    #: too leaves it to that one).
    mine: tuple[str, ...]
    publishes: tuple[bool, ...]
    #: Other splits a group's blocks may have been published in by
    #: engines of other parallelisms.
    others: tuple[tuple[int, ...], ...]
    #: Canonical page bytes of each layer of a sharded group (0 for the
    #: others): part of the identity blocks are shared under.
    canonical: tuple[int, ...]

    @classmethod
    def of(cls, config: Any, info: dict[int, dict[str, Any] | None] | None, rank: int) -> G4Parts:
        """The parts of the engine of ``config`` (its offloaded groups and
        parallelism) for rank ``rank``, with :func:`shards_of`'s ``info``
        (None: every group published per rank)."""
        world = max(1, config.parallel.world_size)
        shards: list[int | None] = []
        own: list[tuple[str, ...]] = []
        mine: list[str] = []
        publishes: list[bool] = []
        others: list[tuple[int, ...]] = []
        canonical: list[int] = []
        for g in config.groups:
            found = info.get(g.group_id) if info else None
            if found is None:
                shards.append(None)
                own.append(tuple(_parallel_name(config, r) for r in range(world)))
                mine.append(_parallel_name(config, rank))
                publishes.append(True)
                others.append(())
                canonical.append(0)
                continue
            s = int(found["shards"])
            copies = max(1, world // s)
            shards.append(s)
            own.append(tuple(shard_name(s, h) for h in range(s)))
            mine.append(shard_name(s, rank // copies))
            publishes.append(rank % copies == 0)
            others.append(tuple(int(d) for d in found["splits"] if int(d) != s))
            canonical.append(int(found["page"]))
        return cls(tuple(shards), tuple(own), tuple(mine), tuple(publishes), tuple(others), tuple(canonical))


@dataclass(frozen=True)
class PageLayout:
    """How a rank's pages of one group lie in the canonical page: what a
    writer publishes beside its shards, and what a reader of another
    split plans its copies with."""

    #: Bytes of the rank's page, and of the canonical page, per layer.
    page: int
    canonical: int
    #: Per layer, vLLM's copy runs: ``(offset in the page, offset in the
    #: canonical page, fragment bytes, fragments, page stride, canonical
    #: stride)``.
    runs: tuple[tuple[tuple[int, int, int, int, int, int], ...], ...]

    @classmethod
    def of_refs(cls, refs: Sequence[Any], shards: int) -> PageLayout | None:
        """The layout of a group whose layers are ``refs`` (vLLM's
        ``CanonicalKVCacheRef``), split in ``shards``; None when vLLM's
        mappings do not relate every layer's page to a canonical page of
        ``shards`` times its bytes."""
        runs, pages, canonicals = [], set(), set()
        for ref in refs:
            m = ref.mapping
            if m is None or not m.parallelism_agnostic or m.local_page_size_bytes != ref.page_size_bytes:
                return None
            pages.add(m.local_page_size_bytes)
            canonicals.add(m.canonical_page_size_bytes)
            runs.append(
                tuple(
                    (
                        r.local_offset,
                        r.canonical_offset,
                        r.fragment_size,
                        r.num_fragments,
                        r.local_stride,
                        r.canonical_stride,
                    )
                    for r in m.runs
                )
            )
        if len(pages) != 1 or len(canonicals) != 1:
            return None
        page, canonical = pages.pop(), canonicals.pop()
        if canonical != shards * page:
            return None
        return cls(page, canonical, tuple(runs))

    def to_bytes(self) -> bytes:
        """What a writer publishes."""
        return json.dumps({"page": self.page, "canonical": self.canonical, "runs": self.runs}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> PageLayout | None:
        """A published layout; None when ``data`` is not one."""
        try:
            d = json.loads(data)
            runs = tuple(tuple(_run(r) for r in layer) for layer in d["runs"])
            return cls(int(d["page"]), int(d["canonical"]), runs)
        except (ValueError, KeyError, TypeError):
            return None

    def fragments(self, layer: int) -> list[Fragment]:
        """Layer ``layer``'s fragments, one per copy."""
        out: list[Fragment] = []
        for lo, co, size, count, ls, cs in self.runs[layer]:
            out.extend((lo + i * ls, co + i * cs, size) for i in range(count))
        return out


def _run(r: Any) -> tuple[int, int, int, int, int, int]:
    """A published copy run; a ValueError when it is not six integers."""
    lo, co, size, count, ls, cs = (int(x) for x in r)
    return lo, co, size, count, ls, cs


@dataclass(frozen=True)
class Plan:
    """How a reader builds its block of a group from another split's
    shards: which shards it reads (their shares, in the order they lie in
    assembly memory), the bytes of each, and the ``(src, dst, bytes)``
    pieces to copy (``PagedWorker.assemble``)."""

    shares: tuple[int, ...]
    shard_bytes: int
    pieces: tuple[tuple[int, int, int], ...]


def plan(reader: PageLayout, writers: dict[int, PageLayout], sum_bytes: int) -> Plan | None:
    """The plan of a reader of layout ``reader`` from the shards of
    writers of the given layouts (by share); None when they are not
    layouts of the same canonical page or do not hold every byte the
    reader needs. A shard is followed by ``sum_bytes`` of checksum."""
    layouts = list(writers.values())
    if not layouts or any(w.canonical != reader.canonical or len(w.runs) != len(reader.runs) for w in layouts):
        return None
    if len({w.page for w in layouts}) != 1:
        return None
    wpage = layouts[0].page
    raw: list[tuple[int, int, int, int]] = []  # (share, src in its shard, dst, bytes)
    for layer in range(len(reader.runs)):
        frags = sorted((co, share, lo, size) for share, w in writers.items() for lo, co, size in w.fragments(layer))
        starts = [f[0] for f in frags]
        for lo, co, size in reader.fragments(layer):
            x, end = co, co + size
            i = bisect.bisect_right(starts, x) - 1
            while x < end:
                if i < 0 or i >= len(frags) or not frags[i][0] <= x < frags[i][0] + frags[i][3]:
                    return None
                wco, share, wlo, wsize = frags[i]
                n = min(end, wco + wsize) - x
                raw.append((share, layer * wpage + wlo + x - wco, layer * reader.page + lo + x - co, n))
                x += n
                i += 1
    shares = tuple(sorted({r[0] for r in raw}))
    shard_bytes = wpage * len(reader.runs)
    at = {share: k * (shard_bytes + sum_bytes) for k, share in enumerate(shares)}
    pieces: list[tuple[int, int, int]] = []
    for share, src, dst, n in sorted(raw, key=lambda r: r[2]):
        src += at[share]
        if pieces and pieces[-1][0] + pieces[-1][2] == src and pieces[-1][1] + pieces[-1][2] == dst:
            pieces[-1] = (pieces[-1][0], pieces[-1][1], pieces[-1][2] + n)
        else:
            pieces.append((src, dst, n))
    return Plan(shares, shard_bytes, tuple(pieces))

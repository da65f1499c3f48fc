"""The prefill service: runs prompts, samples their first tokens, and hands the
prompts' KV to the attention workers layer by layer as each layer finishes.

Prompts that wait while a forward runs are coalesced into the next one (up to
``prefill.max_batch_tokens`` tokens): one StepBatch, attention causal per sequence,
so many short prompts cost about one forward of their total length instead of one
forward each. A long prompt computes a chunk of its tokens a forward
(``prefill.chunk_tokens``, lamina.services.prefill.chunking), its KV kept here between
them, so the prompts queued behind it join its next forward. Each sequence still gets
its own reply from its attention workers, so a refusal (KV full on one worker) fails
that request alone.

The longest cached prefix of the prompt comes from the tiered prefix cache, so
only the rest runs through the model (at least the last token, whose logits give
the first output token); the prompt's full blocks are cached afterwards. The
cache's blocks are published to the metadata store in batches by an owned
BlockPublisher (lamina.kvstore.block_publisher), and withdrawn when the worker stops. When
the scheduler names a peer that caches a longer prefix (PrefillRequest.peer), the
tokens past this worker's own prefix are fetched from that peer over the data plane
(lamina.services.prefill.prefix_peers) instead of computed; this worker's data-plane listener
answers its peers' fetches the same way. While a forward computes, the cached prefixes of
the prompts still waiting move up from host and disk to the cache's device tier on a
worker thread (`prefill.prefetch`, lamina.kvstore.prefetch), protected from eviction until
their own forward has taken them. Prompt
attention runs here, over a local token-granular store that lives only for the
request; the KV of layer i is on its way to the attention workers while layer
i + 1 computes.

A forward goes in steps over one record per prompt (`_Prompt`): prepare (its KV
reserved, the cached prefix installed, a peer's fetched), forward (the split model on a
thread of its own, lamina.services.prefill.forward_thread, so this event loop keeps
answering meanwhile; each layer's KV is sent to the attention workers from the loop as
the next layer computes), sample (the first tokens, and those of a request's other
choices, by lamina.sampling's Sampler), reply.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import prometheus_client
import torch

from lamina import transports
from lamina.aio import install_uvloop
from lamina.engine.kv import KVStore, SequenceKV
from lamina.engine.step import in_process_attention
from lamina.kvstore.block_publisher import BlockPublisher
from lamina.kvstore.prefetch import Prefetcher, PrefetchResult
from lamina.kvstore.prefix_cache import PrefixCache, PrefixCacheConfig
from lamina.model.batch import StepBatch
from lamina.model.quant import set_kernel_threads
from lamina.model.threads import set_compute_threads
from lamina.sampling.logprobs import TokenLogprobs, token_logprobs
from lamina.sampling.params import SamplingParams
from lamina.sampling.sampler import Sampler
from lamina.services.addresses import with_host
from lamina.services.attention_pool import AttentionPool
from lamina.services.config import PrefillSection, StackConfig
from lamina.services.devices import compute_dtype, open_device
from lamina.services.model.model_service import ModelSlices
from lamina.services.prefill.chunking import chunk_tokens, continuing_takes, first_take
from lamina.services.prefill.forward_thread import ForwardThread
from lamina.services.prefill.free_cores import forward_threads, host_cores, others_runnable
from lamina.services.prefill.prefix_peers import PrefixFetcher, PrefixServer
from lamina.services.prefill.prompt_logprobs import logit_rows
from lamina.services.protos import lamina_pb2, lamina_pb2_grpc
from lamina.services.runtime import ServiceRuntime, abort_for_remote_error
from lamina.services.sampling_wire import logprobs_to_proto, params_from_proto
from lamina.services.scheduler.scheduling_policies import MAX_DISTANCE
from lamina.services.warm_up import PROMPT_TOKENS, attend_own, finished, warm_up_inputs
from lamina.services.wire import RemoteError

log = logging.getLogger(__name__)


@dataclass(eq=False)  # one per prompt: compared by identity
class _Prompt:
    """One prompt, from its KV reservation to its reply: in one forward, or in one a
    chunk (chunking), its KV kept here between them."""

    req: lamina_pb2.PrefillRequest
    params: SamplingParams  # its request's, converted once
    token_ids: list[int]
    kv: SequenceKV  # its KV, reserved for the whole prompt in its first forward's store
    fut: asyncio.Future  # its caller's: its result, once its last chunk's forward ended
    cached: int = 0  # prompt tokens not computed: the prefix cache's and a peer's
    done: int = 0  # prompt tokens whose KV is in `kv` (the cached ones, then each chunk's)
    take: int = 0  # the tokens it computes in the forward in progress
    fetched: int = 0  # of which a peer's
    stored: RemoteError | None = None  # an attention worker's refusal of its KV
    sample_row: int = 0  # the row of the forward's logits that samples its first token
    score_rows: list[int] = field(default_factory=list)  # the rows scoring prompt tokens 1.. (echo)
    token: int = 0  # its first output token
    logprobs: TokenLogprobs | None = None
    choice_tokens: list[int] = field(default_factory=list)  # its other choices' first tokens (n > 1)
    choice_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)

    @property
    def seq_id(self) -> str:
        return self.req.seq_id

    @property
    def is_last_chunk(self) -> bool:
        """Whether the forward in progress computes the rest of the prompt."""
        return self.done + self.take == len(self.token_ids)

    @property
    def workers(self) -> list[int]:
        return list(self.req.placement.workers)


class PrefillService:
    def __init__(self, config: StackConfig, index: int = 0) -> None:
        self.config = config
        self.device = open_device("prefill.device", config.prefill.device)
        self.dtype = compute_dtype(config.prefill.compute_dtype)
        self.slices = ModelSlices.load(config.model, config.weights, self.device, self.dtype)
        self.cfg = self.slices.cfg
        self.sampler = Sampler(self.slices.grammars, self.slices.loaded.tokenizer.eos_token_ids)
        # prefill-I: its node in the metadata store's block records, and the scheduler's routing key.
        self.runtime = ServiceRuntime("prefill", f"prefill-{index}", config)
        r = self.runtime.registry
        self.m_prompts = prometheus_client.Counter("lamina_prefill_requests", "prompts prefilled", registry=r)
        self.m_tokens = prometheus_client.Counter("lamina_prefill_tokens", "prompt tokens computed", registry=r)
        self.m_seconds = prometheus_client.Histogram("lamina_prefill_seconds", "prefill time", registry=r)
        self.m_cached = prometheus_client.Counter("lamina_prefill_cached_tokens", "prompt tokens served by the "
                                                  "prefix cache", registry=r)
        pc = config.prefill
        self.publisher = BlockPublisher(self.runtime.store, self.runtime.service_id)
        self.cache = PrefixCache(cache_config(pc, index), on_event=self.publisher.on_event) \
            if pc.cache_device_bytes else None
        self.publisher.cache = self.cache
        self.peer_server = PrefixServer(self.cache) if self.cache is not None else None
        self.fetcher = PrefixFetcher(config.transport_config(), self.cfg, config.deadlines.reply_s)
        self.m_fetched = prometheus_client.Counter("lamina_prefill_fetched_tokens", "prompt tokens whose KV was "
                                                   "fetched from a peer prefill worker", registry=r)
        self.compute_tokens_per_s: float | None = None  # running figure of this worker's forwards
        self.m_warm_up = prometheus_client.Gauge(
            "lamina_prefill_warm_up_seconds", "the warm-up forward's seconds, before the worker served (0: none, "
            "warm_up false)", registry=r)
        self.num_prompt_tokens = 0  # prompt tokens of the prompts prefilled
        self.num_cached_tokens = 0  # of which the prefix cache served (not computed)
        self.num_fetched_tokens = 0  # of which fetched from peers (not computed)
        self.num_prefetched_blocks = 0  # cache blocks the prefetcher moved up to device (m_prefetched)
        self.m_batch = prometheus_client.Histogram(
            "lamina_prefill_batch_prompts", "prompts per prefill forward", buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r)
        self.m_deferred = prometheus_client.Counter(
            "lamina_prefill_deferred", "prompts held for the next forward because a prompt of the forward "
            "computes blocks of their prefix", registry=r)
        self.m_abandoned = prometheus_client.Counter(
            "lamina_prefill_abandoned", "prompts dropped before their last forward (unforwarded, or between two "
            "chunks): their callers went away (cancelled, or past their deadline)", registry=r)
        self.pool: AttentionPool | None = None
        # Forwards run off this event loop, which keeps serving meanwhile (forward_thread).
        self.forward_thread = ForwardThread(self.device)
        self._queue: list[tuple[lamina_pb2.PrefillRequest, asyncio.Future]] = []
        # Prompts computed in chunks, in arrival order, between their forwards (chunking).
        self.chunk_tokens = chunk_tokens(pc.chunk_tokens, self.device.type)
        self._continuing: list[_Prompt] = []
        self.m_chunks = prometheus_client.Counter(
            "lamina_prefill_chunks", "forwards of a part of a prompt before its last (prefill.chunk_tokens): "
            "the prompts queued meanwhile joined the next one", registry=r)
        self._wake = asyncio.Event()
        self._num_queued = 0  # prompts ever queued: a prefetch run knows whether more came since it began
        # The prefetcher keys each waiting prompt by id(request): the request object lives
        # in the queue, then in its batch, until its protection is released (_prepare).
        self.prefetcher = Prefetcher(self.cache) if self.cache is not None and pc.prefetch else None
        self.m_prefetched = prometheus_client.Counter(
            "lamina_prefill_prefetched_blocks", "prefix-cache blocks moved up from host or disk to the device tier "
            "ahead of a waiting prompt's prefill (prefill.prefetch)", registry=r)
        self._prefetch: asyncio.Future[PrefetchResult] | None = None  # the run in flight, on a worker thread
        self._prefetch_stop = threading.Event()  # asks that run to end at its next block
        self._prefetch_seen = 0  # _num_queued when that run took its snapshot of the queue
        self._is_prefetch_open = False  # runs may start: a forward computes, no batch is being taken
        # Each forward's compute threads: the host's cores other threads leave, at most this many.
        self.max_threads = config.prefill_threads
        self.m_threads = prometheus_client.Counter(
            "lamina_prefill_forwards", "prefill forwards by their compute threads: the host's cores that other "
            "processes' threads left free, at most prefill.threads", ["threads"], registry=r)

    async def prefill(self, req: lamina_pb2.PrefillRequest) -> lamina_pb2.PrefillResult:
        """Queue one prompt for the next forward and wait for its first token."""
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((req, fut))
        self._num_queued += 1
        self._wake.set()
        self._start_prefetch()  # its prefix moves up while the forward in progress computes
        return await fut

    async def _batch_loop(self) -> None:
        window = self.config.prefill.batch_window_ms / 1000
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue or self._continuing:
                # A burst of requests comes over tens of milliseconds: give its rest a
                # moment to join this batch, and see meanwhile how many threads of other
                # processes want the cores.
                threads = 1
                queued = self._num_queued
                if self.max_threads > 1:
                    others = await others_runnable(window)
                    if self._queue and await self._rest_of_burst(queued, window):
                        # The services that passed the burst on were runnable while it came.
                        others = await others_runnable(window)
                    threads = forward_threads(self.max_threads, host_cores(), others)
                    set_kernel_threads(threads)
                elif window and self._queue:
                    await asyncio.sleep(window)
                    await self._rest_of_burst(queued, window)
                # Requests leave the queue only while no prefetch run is in flight, so a
                # request taken is never named by a run after its release (Prefetcher).
                await self._end_prefetch()
                if not self._drop_abandoned():
                    continue
                going, batch = self._take_forward()
                self.m_threads.labels(threads=str(threads)).inc()
                reqs = [r for r, _ in batch]
                finished: Sequence[tuple[asyncio.Future, lamina_pb2.PrefillResult | BaseException]]
                try:
                    finished = await self._prefill_batch(going, batch)
                except Exception as exc:  # e.g. an attention worker's connection failed
                    log.warning("a prefill forward of %d prompts failed", len(going) + len(batch), exc_info=True)
                    drop_frames(exc)
                    finished = [(p.fut, exc) for p in going] + [(fut, exc) for _, fut in batch]
                    for seq_id in [p.seq_id for p in going] + [r.seq_id for r in reqs]:
                        self._pool.forget_stored(seq_id)
                finally:
                    self._is_prefetch_open = False  # opened by _prepare, once the batch's prefixes are in
                for fut, res in finished:
                    if fut.done():  # the caller went away (RPC cancelled)
                        continue
                    if isinstance(res, BaseException):
                        fut.set_exception(res)
                    else:
                        fut.set_result(res)

    def _take_forward(self) -> tuple[list[_Prompt], list[tuple[lamina_pb2.PrefillRequest, asyncio.Future]]]:
        """The next forward's prompts: those in progress that compute a chunk in it (their
        `take` set), then the queued ones it has room for (chunking's policy)."""
        chunk, max_tokens = self.chunk_tokens, self.config.prefill.max_batch_tokens
        takes = continuing_takes([len(p.token_ids) - p.done for p in self._continuing], chunk, max_tokens)
        for p, n in zip(self._continuing, takes):
            p.take = n
        going = [p for p in self._continuing if p.take]
        self._continuing = [p for p in self._continuing if not p.take]
        room = max_tokens - sum(p.take for p in going)
        if not self._queue or (going and room <= 0):
            return going, []
        batch = take_batch(self._queue, room, self._waits if self.cache is not None else None,
                           size=lambda req: first_take(len(req.token_ids), chunk, bool(req.prompt_logprobs)))
        return going, batch

    def _drop_abandoned(self) -> bool:
        """`drop_abandoned` on the queue, ending the dropped requests' prefetch protection,
        and the prompts in progress whose callers went away (their KV with them); whether
        any prompt is left. Called with no prefetch run in flight."""
        release = None if self.prefetcher is None else self.prefetcher.release
        gone = drop_abandoned(self._queue, release)
        left = [p for p in self._continuing if not p.fut.done()]
        self.m_abandoned.inc(gone + len(self._continuing) - len(left))
        self._continuing = left
        return bool(self._queue or self._continuing)

    async def _rest_of_burst(self, queued: int, window: float) -> bool:
        """The batch waits for the rest of a burst (`rest_of_burst`); True when it did."""
        cfg = self.config.prefill
        return await rest_of_burst(lambda: self._num_queued, lambda: queued_tokens(self._queue), queued, window,
                                   cfg.batch_window_max_ms / 1000, cfg.max_batch_tokens)

    # Thread safety of the prefetch: the prefix cache guards its structures with one lock and
    # reads disk outside it (the block locked and marked in flight, one transfer per block),
    # as its peer server's thread already relies on; so a run on a worker thread may promote
    # while this loop looks up, acquires and inserts, and a prefill asking for a block in
    # transfer waits for that transfer. Running the prefetch between batches instead (or
    # under a lock of its own) would give up the overlap with the forward it is for. What
    # the cache cannot order is the protection's bookkeeping, which these three keep: a run
    # names only requests still queued (a snapshot taken on this loop), at most one runs at
    # a time, and a batch is taken only once the run in flight has ended (`_end_prefetch`),
    # so a request's release (in `_prepare`, after its prefix is in the forward's KV) comes
    # after every run that protected it.
    def _start_prefetch(self) -> None:
        """Start a prefetch run over the prompts waiting (on a worker thread), unless
        runs are closed or one is in flight (which starts another as it ends if more came)."""
        if self.prefetcher is None or not self._is_prefetch_open or self._prefetch is not None:
            return
        upcoming = [(id(r), list(r.token_ids[:-1])) for r, _ in self._queue
                    if not r.prompt_logprobs and len(r.token_ids) > 1]  # the prompts `_install_prefix` looks up
        if not upcoming:
            return
        self._prefetch_stop = threading.Event()
        self._prefetch_seen = self._num_queued
        run = asyncio.ensure_future(asyncio.to_thread(self.prefetcher.run, upcoming, self._prefetch_stop))
        self._prefetch = run
        run.add_done_callback(self._prefetched)

    def _prefetched(self, run: asyncio.Future[PrefetchResult]) -> None:
        if self._prefetch is run:
            self._prefetch = None
        if run.cancelled():
            return
        if (exc := run.exception()) is not None:  # the prefill itself moves what it needs
            log.warning("a prefix prefetch failed", exc_info=exc)
        else:
            self.m_prefetched.inc(run.result().num_promoted)
            self.num_prefetched_blocks += run.result().num_promoted
        if self._num_queued != self._prefetch_seen:
            self._start_prefetch()

    async def _end_prefetch(self) -> None:
        """Stop the run in flight at its next block and wait for it (a thread cannot be
        cancelled; its next block is the longest wait)."""
        run = self._prefetch
        if run is not None:
            self._prefetch_stop.set()
            await asyncio.wait({run})

    def _waits(self, req: lamina_pb2.PrefillRequest, taken: list[lamina_pb2.PrefillRequest]) -> bool:
        """Whether `req` waits for the next forward: a prompt of this one computes a block
        of its prefix that the cache does not hold yet (a conversation's turns sent close
        together), which it then reads from the cache instead of computing it again."""
        if req.prompt_logprobs or self.cache is None:
            return False
        cached = self.cache.lookup(req.token_ids[:-1]).num_tokens
        others = [t.token_ids for t in taken if not t.prompt_logprobs]
        if shares_uncached_block(req.token_ids, cached, others, self.config.prefill.cache_block_tokens):
            self.m_deferred.inc()
            return True
        return False

    async def _prefill_batch(self, going: list[_Prompt],
                             batch: list[tuple[lamina_pb2.PrefillRequest, asyncio.Future]]
                             ) -> list[tuple[asyncio.Future, lamina_pb2.PrefillResult | RemoteError]]:
        """One forward: the next chunk of each prompt in progress (`going`, their `take`
        set), and the queued prompts of `batch`, whole or their first chunk. Each prompt
        whose last chunk it computed gets its result, or its attention workers' refusal
        (RemoteError), beside its caller's future; the others wait for their next chunk.
        Any other failure fails them all (raised)."""
        start = time.perf_counter()
        kv, fresh = await self._prepare(batch, sum(p.kv.nbytes() for p in going))
        for p in fresh:
            p.take = first_take(len(p.token_ids) - p.done, self.chunk_tokens, bool(p.req.prompt_logprobs))
        for p in going:  # its KV, kept from its last chunk, joins this forward's store
            kv.adopt(p.seq_id, p.kv)
        prompts = going + fresh
        output = await self._forward(kv, prompts)
        ends = [p.is_last_chunk for p in prompts]
        for p, end in zip(prompts, ends):
            p.done += p.take
            if not end:
                self._continue(p)
        last = [p for p, end in zip(prompts, ends) if end]
        self._sample(last, output)
        results = [(p.fut, self._reply(p)) for p in last]
        self.m_batch.observe(len(prompts))
        self.m_seconds.observe(time.perf_counter() - start)
        return results

    def _continue(self, p: _Prompt) -> None:
        """A prompt with chunks left waits for its next forward; its full blocks so far go
        to the prefix cache now, so a prompt sharing them that was held back for this
        forward (`_waits`) finds them there."""
        p.take = 0
        self._continuing.append(p)
        self.m_chunks.inc()
        if self.cache is not None and not p.req.prompt_logprobs:
            self.cache.insert(p.token_ids[:p.done], p.kv.buf[:, :, :p.done])

    async def _prepare(self, batch: list[tuple[lamina_pb2.PrefillRequest, asyncio.Future]], adopted_bytes: int
                       ) -> tuple[KVStore, list[_Prompt]]:
        """The forward's KV store, and each queued prompt's KV reserved there (for its
        whole length), holding the longest prefix the cache or a named peer has of it;
        `adopted_bytes` are left for the KV of the prompts in progress."""
        reqs = [r for r, _ in batch]
        try:
            kv = KVStore(self.cfg, device=self.device, dtype=self.dtype,
                         capacity_bytes=sum(len(r.token_ids) + 64 for r in reqs)
                         * self.cfg.kv_bytes_per_token(self.dtype.itemsize)
                         + adopted_bytes)
            prompts = [_Prompt(r, params_from_proto(r.params), list(r.token_ids),
                               kv.reserve(r.seq_id, len(r.token_ids)), fut) for r, fut in batch]
            for p in prompts:
                # A prompt that wants its own tokens' logprobs is computed whole: no cached prefix.
                if not p.req.prompt_logprobs:
                    p.cached = self._install_prefix(p.token_ids, p.kv)
        finally:
            if self.prefetcher is not None:  # their prefixes are in the forward's KV now (or never will be)
                for r in reqs:
                    self.prefetcher.release(id(r))
        # The prompts left waiting: their prefixes move up while this batch computes.
        self._is_prefetch_open = True
        self._start_prefetch()
        asks = [p for p in prompts if p.req.HasField("peer") and not p.req.prompt_logprobs
                and min(p.req.peer.tokens, len(p.token_ids) - 1) > p.cached]
        got = await asyncio.gather(*(self._fetch_prefix(p.req.peer, p.token_ids, p.kv, p.cached)
                                     for p in asks))  # concurrent: each peer's link serves one at a time
        for p, n in zip(asks, got):
            p.fetched, p.cached = n - p.cached, n
        for p in prompts:
            p.done = p.cached
        return kv, prompts

    async def _forward(self, kv: KVStore, prompts: list[_Prompt]) -> torch.Tensor:
        """Run each prompt's `take` tokens after its `done` ones through the slices; a
        prompt's KV goes to its attention workers layer by layer, as each is computed, in
        the forward of its last chunk. Returns the scored rows' logits [R, V] on the
        prefill device once every worker answered (a refusal is kept in `stored`)."""
        computing = time.perf_counter()
        batch = StepBatch.build([p.seq_id for p in prompts], [p.token_ids[p.done:p.done + p.take] for p in prompts],
                                [p.done for p in prompts])
        local = in_process_attention(kv, batch)
        rows, last_rows, prompt_rows = logit_rows(batch.query_lens, [p.req.prompt_logprobs for p in prompts])
        for p, last, scoring in zip(prompts, last_rows, prompt_rows):
            p.sample_row, p.score_rows = last, scoring
        inputs = {**batch.model_inputs(self.device), "logits_index": rows.to(self.device)}
        sending = [p for p in prompts if p.is_last_chunk]

        async def send_layer(i: int) -> None:  # on this loop, as layer i+1 computes on the forward's thread
            for p in sending:
                n = len(p.token_ids)
                # Where the KV is: on a GPU the transport stages it through pinned host
                # memory asynchronously (cuda_ipc carries it on the GPU).
                await self._pool.store_layer(p.seq_id, p.workers, i, p.kv.buf[i, 0, :n], p.kv.buf[i, 1, :n])

        output = await self.forward_thread.run(self.slices.split, inputs, local.attend, send_layer)
        local.commit()
        self._measure_compute(sum(p.take for p in prompts), time.perf_counter() - computing)
        # One acknowledgement per sequence and worker, matched by sequence id.
        for p in sending:
            try:
                await self._pool.wait_stored(p.seq_id)
            except RemoteError as exc:
                p.stored = exc
        return output

    def _sample(self, prompts: list[_Prompt], output: torch.Tensor) -> None:
        """Each prompt's first token and its other choices' (n > 1): rows of the same
        logits, sampled in one call, each choice with its own seed (`choice_seeds`), so
        the choices are independent and each is reproducible from its seed alone. Only
        the prompt counts for a first token's penalties (a rebuild's prefill samples too,
        but its token is used only when the request had no output yet)."""
        seqs = [self.sampler.join(p.params, p.token_ids) for p in prompts]
        rows = [p.sample_row for p in prompts]
        for p in prompts:
            seqs.extend(self.sampler.join(p.params, p.token_ids, seed=seed) for seed in p.req.choice_seeds)
            rows.extend(p.sample_row for _ in p.req.choice_seeds)
        tokens, logprobs = self.sampler(output[rows], seqs)  # one row per prompt, then one per choice
        start = len(prompts)
        for p, token, lp in zip(prompts, tokens, logprobs):
            end = start + len(p.req.choice_seeds)
            p.token, p.logprobs = token, lp
            p.choice_tokens, p.choice_logprobs = tokens[start:end], logprobs[start:end]
            start = end
            # Only an echo request scores its prompt (its rows are then every position).
            if p.score_rows and p.stored is None:
                p.prompt_logprobs = token_logprobs(output[p.score_rows], p.token_ids[1:],
                                                   [p.params.logprobs or 0] * len(p.score_rows))

    def _reply(self, p: _Prompt) -> lamina_pb2.PrefillResult | RemoteError:
        """A prompt's result (its full blocks cached, its figures counted), or its refusal."""
        if p.stored is not None:
            return p.stored
        n, c, f = len(p.token_ids), p.cached, p.fetched
        if self.cache is not None:
            self.cache.insert(p.token_ids, p.kv.buf[:, :, :n])
        self.m_prompts.inc()
        self.m_tokens.inc(n - c)
        self.m_cached.inc(c - f)
        self.m_fetched.inc(f)
        self.num_prompt_tokens += n
        self.num_cached_tokens += c - f
        self.num_fetched_tokens += f
        return lamina_pb2.PrefillResult(
            token_id=p.token, cached_tokens=c, fetched_tokens=f,
            logprobs=None if p.logprobs is None else logprobs_to_proto(p.logprobs),
            prompt_logprobs=[logprobs_to_proto(e) for e in p.prompt_logprobs if e is not None],
            choice_token_ids=p.choice_tokens,
            choice_logprobs=[logprobs_to_proto(e) for e in p.choice_logprobs if e is not None])

    @property
    def _pool(self) -> AttentionPool:
        if self.pool is None:
            raise RuntimeError("the prefill service has no attention pool before it runs")
        return self.pool

    def tier_distances(self, prompts: list[list[int]]) -> list[int]:
        if self.cache is None:
            return [MAX_DISTANCE] * len(prompts)
        return [self.cache.tier_distance(p[:-1]) for p in prompts]

    def _install_prefix(self, token_ids: list[int], seq_kv: SequenceKV) -> int:
        """Copy the longest cached prefix into the sequence's KV; returns its length.
        The last prompt token is always computed: its logits give the first token."""
        if self.cache is None or len(token_ids) < 2:
            return 0
        with self.cache.acquire(token_ids[:-1]) as handle:
            if handle.num_tokens and handle.kv is not None:  # (kv is None exactly on a miss)
                seq_kv.buf[:, :, : handle.num_tokens] = handle.kv  # [L, 2, P, Hkv, D]
                seq_kv.length = handle.num_tokens
            return handle.num_tokens

    async def _fetch_prefix(self, peer: lamina_pb2.PeerPrefix, token_ids: list[int], seq_kv: SequenceKV,
                            have: int) -> int:
        """Fetch the KV of token_ids[have:peer.tokens] from the peer into the sequence's
        KV (after the `have` tokens already there); returns the tokens now held. The
        last prompt token is always computed, as for a cached prefix."""
        want = min(peer.tokens, len(token_ids) - 1)
        num_tokens, kv = await self.fetcher.fetch(peer.address, token_ids[:want], have)
        if kv is None:
            return have
        seq_kv.buf[:, :, have:num_tokens] = kv  # [L, 2, num_tokens - have, Hkv, D]
        seq_kv.length = num_tokens
        return num_tokens

    def _measure_compute(self, tokens: int, seconds: float) -> None:
        """Keep a running figure of this worker's forward rate (tokens per second), by which
        the scheduler weighs fetching a prefix against computing it."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        old = self.compute_tokens_per_s
        self.compute_tokens_per_s = rate if old is None else 0.7 * old + 0.3 * rate

    def stats(self) -> dict:
        """Figures published to the metadata store every second (lamina status, and the
        scheduler's choice between fetching a peer's prefix and computing it)."""
        return {"prompt_tokens": self.num_prompt_tokens, "hit_tokens": self.num_cached_tokens,
                "fetched_tokens": self.num_fetched_tokens,
                "served_tokens": self.peer_server.num_served_tokens if self.peer_server else 0,
                "compute_tokens_per_s": self.compute_tokens_per_s, "fetch_bytes_per_s": self.fetcher.bytes_per_s,
                "kv_bytes_per_token": self.cfg.kv_bytes_per_token(), "prefetched_blocks": self.num_prefetched_blocks,
                # the cache's hits by the tier each block was in when its prompt asked
                "hit_tokens_by_tier": dict(self.cache.stats.hit_tokens_by_tier) if self.cache is not None else {}}

    async def warm_up(self) -> float:
        """One forward of a made-up prompt on the forward thread (services/warm_up.py),
        before the worker registers; its KV and output thrown away, its time not counted
        in the forward rate. Returns its seconds."""
        inputs = warm_up_inputs(self.cfg.vocab_size, PROMPT_TOKENS, self.device)
        started = time.perf_counter()

        async def nothing_to_send(i: int) -> None:
            """Layer i's KV goes to no attention worker: the warm-up's is thrown away."""

        await self.forward_thread.run(self.slices.split, inputs, attend_own, nothing_to_send)
        seconds = finished(self.device, started)
        self.m_warm_up.set(seconds)
        log.info("warm-up forward of %d tokens: %.0f ms", PROMPT_TOKENS, 1000 * seconds)
        return seconds

    async def run(self) -> None:
        if self.config.warm_up:  # first: the attention workers it waits for next may still be starting
            await self.warm_up()
        self.pool = await AttentionPool.from_registry(self.runtime.store, self.config, self.cfg)
        meta: dict = {"device": str(self.device)}
        if self.peer_server is not None:  # peers fetch prefix KV from here
            address = await self.peer_server.start(self.config.data_address(self.runtime.service_id),
                                                   self.config.transport_config())
            meta["data"] = with_host(address, self.config.advertised_host)
        batcher = asyncio.create_task(self._batch_loop(), name="prefill-batches")
        if self.cache is not None:
            self.publisher.start()  # its first batch: everything the cache holds (its disk tier's blocks)
        try:
            await self.runtime.serve(lambda s: lamina_pb2_grpc.add_PrefillServicer_to_server(_PrefillServicer(self), s),
                                     meta=meta, rebuild=self.publisher.rebuild, stats=self.stats,
                                     drained=lambda: self.publisher.close(withdraw=self.cache is not None))
        finally:
            await self.publisher.close()
            batcher.cancel()
            await asyncio.gather(batcher, return_exceptions=True)
            self._is_prefetch_open = False
            await self._end_prefetch()  # the batch loop's last run, if it was cancelled during a forward
            self.forward_thread.close()
            for _, fut in self._queue:
                fut.cancel()
            for p in self._continuing:
                p.fut.cancel()
            await self.fetcher.close()
            if self.peer_server is not None:
                await self.peer_server.stop()
            await self.pool.close()


def drop_frames(exc: BaseException) -> None:
    """Drop the traceback of `exc` and of each exception it was raised from or during.
    A failed forward's frames hold its whole KV (megabytes a prompt) and are reachable
    only through those tracebacks, in reference cycles that only Python's rare full
    collection frees: under partitions each failed forward's KV piled up
    (bench/soak.py --hosts: +190 MiB of tensors after 10 partitions, all freed by one
    gc.collect()). Without their tracebacks the frames go at once. (Clearing the frames
    instead would also finalize any coroutine still suspended in one of them.) Call it
    once the traceback is logged."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        e.__traceback__ = None
        e = e.__cause__ or e.__context__


def cache_config(pc: PrefillSection, index: int) -> PrefixCacheConfig:
    """Prefill worker `index`'s prefix cache, as the configuration's prefill section sets it
    (its device tier on the worker's compute device)."""
    return PrefixCacheConfig(block_size=pc.cache_block_tokens, device=pc.device, device_bytes=pc.cache_device_bytes,
                             host_bytes=pc.cache_host_bytes, disk_bytes=pc.cache_disk_bytes,
                             disk_dir=pc.worker_cache_dir(index), eviction=pc.cache_eviction,
                             quantize_4bit=pc.cache_quantize_4bit, quant_group_size=pc.cache_quant_group_size)


async def rest_of_burst(arrivals: Callable[[], int], tokens: Callable[[], int], seen: int, window_s: float,
                        max_wait_s: float, max_tokens: int) -> bool:
    """While prompts keep coming (`arrivals()`, the count of prompts ever queued, grew in
    the last `window_s`; `seen` of them had come before it), wait another `window_s`: at
    most `max_wait_s` in all, and only while the queue's `tokens()` are under a forward's
    `max_tokens`. True when it waited at all.

    A burst of requests reaches the prefill worker over tens of milliseconds (its RPC
    server hands over a few calls per loop turn); a 5 ms window then took 1, 7, 15 and
    25 of 48 requests sent at once in four forwards (measured while forwards still ran on
    the event loop), each slowed by the decode steps of the ones before. Waiting while they
    come puts the burst in one forward."""
    deadline = time.monotonic() + max_wait_s
    waited = False
    while window_s > 0 and arrivals() > seen and time.monotonic() < deadline and tokens() < max_tokens:
        seen = arrivals()
        waited = True
        await asyncio.sleep(window_s)
    return waited


def queued_tokens(queue: list) -> int:
    """The prompt tokens of the queue's (request, future) pairs."""
    return sum(len(req.token_ids) for req, _ in queue)


def drop_abandoned(queue: list, release: Callable[[Hashable], None] | None) -> int:
    """Remove the queue's (request, future) pairs whose callers went away (the future done:
    the call was cancelled, or outlived its deadline, as the scheduler's does when it takes
    this worker for lost), so that no forward computes for nobody; `release(id(request))`
    for each (its prefetch protection); how many were removed."""
    gone = [req for req, fut in queue if fut.done()]
    queue[:] = [(req, fut) for req, fut in queue if not fut.done()]
    if release is not None:
        for req in gone:
            release(id(req))
    return len(gone)


def take_batch(queue: list, max_tokens: int, waits: Callable[[Any, list], bool] | None = None,
               size: Callable[[Any], int] | None = None) -> list:
    """Remove and return the queue's (request, future) pairs, in order, whose prompts add
    up to at most ``max_tokens`` (always at least one: a long prompt runs alone; a
    prompt adds ``size(request)``, by default its length: under chunking its first
    chunk's), leaving
    queued those for which ``waits(request, requests taken so far)`` is true; the taking
    stops at the first prompt that does not fit. The head never waits, so a request
    left queued is taken by a later batch at the latest once it is at the head."""
    total = 0
    taken: list = []
    taken_reqs: list = []
    keep: list = []
    for i, (req, fut) in enumerate(queue):
        if taken and waits is not None and waits(req, taken_reqs):
            keep.append((req, fut))
            continue
        tokens = len(req.token_ids) if size is None else size(req)
        if taken and total + tokens > max_tokens:
            keep.extend(queue[i:])
            break
        total += tokens
        taken.append((req, fut))
        taken_reqs.append(req)
    queue[:] = keep
    return taken


def shares_uncached_block(tokens: Sequence[int], cached: int, others: Sequence[Sequence[int]],
                          block_size: int) -> bool:
    """True when a prompt shares with one of `others` a prefix at least one block longer
    than the `cached` tokens its prefix cache holds: computed in the same forward, both
    would compute that block; computed after the other, it finds it cached."""
    want = cached + block_size
    if len(tokens) - 1 < want:  # the last token is always computed
        return False
    head = list(tokens[:want])
    return any(len(o) >= want and list(o[:want]) == head for o in others)


class _PrefillServicer(lamina_pb2_grpc.PrefillServicer):
    def __init__(self, service: PrefillService) -> None:
        self.service = service

    async def TierDistances(self, request, context):  # noqa: N802
        return lamina_pb2.TierDistanceResult(distances=self.service.tier_distances(
            [list(p.token_ids) for p in request.prompts]))

    async def Prefill(self, request, context):  # noqa: N802
        try:
            return await self.service.prefill(request)
        except (RemoteError, transports.TransportError) as exc:
            await abort_for_remote_error(context, exc)


def serve(config: StackConfig, threads: int | None = None, index: int = 0) -> None:
    if threads:  # `lamina prefill --threads`: the limit of every forward's threads
        config = dataclasses.replace(config, prefill=dataclasses.replace(config.prefill, threads=threads))
    set_compute_threads(config.prefill_threads)
    install_uvloop()
    asyncio.run(PrefillService(config, index).run())

"""A transformers-based rollout for verl, registered under the rollout name ``hf``.

Why it exists: verl 0.9.1's trainer generates through rollout *replicas* (``verl.workers.rollout.replica``)
that launch token-in-token-out servers (vLLM, SGLang, TensorRT-LLM); none of them runs without a GPU build,
and neither vLLM nor SGLang is installed on CPU machines. This module plugs a plain ``transformers``
sampler into verl's two rollout extension points, so that the real trainer, agent loop, load balancer,
checkpoint manager and reward loop run unchanged on CPU:

* ``RolloutReplicaRegistry.register("hf", ...)`` (``replica.py``): :class:`HFReplica` launches one
  :class:`HFRolloutServer` Ray actor per replica, named ``hf_server_<replica>_0`` like verl's own servers.
* ``verl.workers.rollout.base._ROLLOUT_REGISTRY[("hf", "async")]`` (the table ``get_rollout_class``
  reads; verl has no register function for it): :class:`HFServerAdapter` is the rollout object that lives in
  the hybrid actor worker. On ``update_weights`` it gathers the trainer's full tensors and ships them to its
  replica's server, so rollouts after a sync use the new policy (verl's "naive" checkpoint backend).

The server returns, with ``rollout.calculate_log_probs=true``, the log-probability of every sampled token
under the *sampling* distribution (logits / temperature, before top-k/top-p truncation, as vLLM's
``processed_logprobs``), which verl stores as ``rollout_log_probs``: bypass mode uses them as the behaviour
log-probs. The server also honours verl's partial-rollout protocol (``abort_all_requests`` stops requests
between tokens and returns them with ``stop_reason="aborted"``; ``resume_generation`` reopens admission),
which the async trainers use around a weight sync, and tags every output with the weight version
(``global_steps``) it was sampled from, which is how verl measures off-policy lag.

Select it with ``actor_rollout_ref.rollout.name=hf`` (the CPU recipe sets it, see ``vcpo.verl_plugin.cpu``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Generator, Iterable
from dataclasses import dataclass
from typing import Any

import ray
import torch
from verl.workers.rollout import base as rollout_base
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutMode, RolloutReplica, RolloutReplicaRegistry, TokenOutput

from vcpo.upstream import require
from vcpo.verl_plugin.cpu.checkpoint import host_named_tensors

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))

ROLLOUT_NAME = "hf"
SERVER_PREFIX = f"{ROLLOUT_NAME}_"


def server_actor_name(replica_rank: int, node_rank: int = 0) -> str:
    """verl's server naming (``<rollout>_server_<replica>_<node>``), which ``ServerAdapter``s look up."""
    return f"{SERVER_PREFIX}server_{replica_rank}_{node_rank}"


def _get(config: Any, key: str, default: Any = None) -> Any:
    getter = getattr(config, "get", None)
    if getter is not None:
        try:
            return getter(key, default)
        except Exception:  # dataclass configs without .get for unknown keys
            pass
    return getattr(config, key, default)


def _token_ids(value: Any) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, list | tuple) else {int(value)}


def sample_next_tokens(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``[rows, vocab]`` logits; returns (tokens, their log-probs under logits / temperature).

    ``temperature <= 0`` is greedy. The log-prob is taken before top-k / top-p truncation, like vLLM's
    ``processed_logprobs``, which is what the trainer recomputes (it scales logits by the same temperature).
    """
    logits = logits.float()
    if temperature is None or temperature <= 0:
        tokens = torch.argmax(logits, dim=-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None])[:, 0]
    log_probs = torch.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)
    probs = log_probs.exp()
    if top_k is not None and 0 < top_k < probs.shape[-1]:
        kth = torch.topk(probs, top_k, dim=-1).values[:, -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
    if top_p is not None and 0.0 < top_p < 1.0:
        sorted_probs, sorted_idx = torch.sort(probs, dim=-1, descending=True)
        # a token is dropped when the tokens ranked above it already hold more than top_p (the first one always stays)
        above = sorted_probs.cumsum(dim=-1) - sorted_probs
        probs = probs.scatter(-1, sorted_idx, sorted_probs.masked_fill(above > top_p * sorted_probs.sum(-1, keepdim=True), 0.0))
    # inverse-CDF sampling: one uniform per row (torch.multinomial draws one exponential per vocabulary entry)
    cdf = probs.double().cumsum(dim=-1)
    uniform = torch.rand(probs.shape[0], 1, generator=generator, dtype=torch.float64)
    tokens = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).clamp_(max=probs.shape[-1] - 1)[:, 0]
    return tokens, log_probs.gather(-1, tokens[:, None])[:, 0]


@dataclass(frozen=True)
class Sampling:
    """What a request samples with; requests with equal settings decode in one batch."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    ignore_eos: bool = False

    @classmethod
    def of(cls, params: dict[str, Any]) -> Sampling:
        def value(key: str, default: Any) -> Any:
            return default if params.get(key) is None else params[key]

        return cls(float(value("temperature", 1.0)), int(value("top_k", -1)), float(value("top_p", 1.0)),
                   bool(value("ignore_eos", False)))


@dataclass
class _Request:
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    epoch: int  # the abort epoch it was admitted in: a later abort stops it
    result: asyncio.Future


class HFRolloutServer:
    """Token-in-token-out sampler over a ``transformers`` causal LM, with verl's rollout-server methods.

    Requests queue on the actor's event loop and decode in batches: the requests that arrive together (the
    agent loop submits a step's prompts x responses at once; a batch waits `ADMISSION_WAIT_S` after the last
    arrival, up to `max_batch` rows) with the same sampling settings run as one left-padded batch with the KV
    cache, one token per forward for all rows, so the weights are read once per token for the whole batch
    rather than once per request. A row leaves the batch at its end-of-sequence token or its token limit.
    """

    # a request arriving within this many seconds of the previous one joins its batch (verl's agent loop sends
    # a step's requests within milliseconds; one decode step of a 135M model takes tens of milliseconds)
    ADMISSION_WAIT_S = 0.05

    def __init__(
        self,
        config: Any,
        model_config: Any,
        rollout_mode: RolloutMode,
        replica_rank: int = 0,
        node_rank: int = 0,
        **_: Any,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.rollout_mode = rollout_mode
        self.replica_rank = replica_rank
        self.node_rank = node_rank
        self.global_steps: int | None = None
        self.model = None
        self.eos_token_ids: set[int] = set()
        self._model_lock = threading.Lock()
        self._abort_epoch = 0
        self._submission_paused = False
        self._rejecting = False
        self._resume_event: asyncio.Event | None = None
        self._in_flight = 0
        self._weights_version = 0
        self._queue: list[_Request] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._arrival: asyncio.Event | None = None
        self._decoder: asyncio.Task | None = None
        self.max_batch = max(1, int(os.environ.get("VCPO_HF_ROLLOUT_MAX_BATCH", "64")))
        seed = int(_get(config, "seed", 0) or 0) + replica_rank
        self._generator = torch.Generator().manual_seed(seed)
        torch.set_num_threads(max(1, int(os.environ.get("VCPO_HF_ROLLOUT_THREADS", "1"))))

    # ------------------------------------------------------------------ lifecycle
    def _events(self) -> asyncio.Event:
        if self._resume_event is None:
            self._resume_event = asyncio.Event()
            self._resume_event.set()
        return self._resume_event

    async def launch_server(self, **_: Any) -> None:
        from transformers import AutoModelForCausalLM, GenerationConfig

        path = _get(self.model_config, "local_path", None) or _get(self.model_config, "path")
        trust_remote_code = bool(_get(self.model_config, "trust_remote_code", False))
        dtype = str(_get(self.config, "dtype", "float32") or "float32")
        torch_dtype = getattr(torch, dtype, torch.float32) if dtype != "auto" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch_dtype, trust_remote_code=trust_remote_code, attn_implementation="sdpa"
        )
        model.eval()
        self.model = model
        eos = _token_ids(getattr(model.config, "eos_token_id", None))
        try:
            eos |= _token_ids(GenerationConfig.from_pretrained(path).eos_token_id)
        except OSError:  # no generation_config.json
            pass
        self.eos_token_ids = {int(t) for t in eos}
        self._events()

    def get_server_address(self) -> tuple[str, int]:
        # The load balancer keys servers by address; nothing connects to it (generation goes by Ray handle).
        return f"hf-replica-{self.replica_rank}", self.node_rank

    # ------------------------------------------------------------------ generation
    def _decode_batch(self, requests: list[_Request]) -> list[tuple[list[int], list[float], bool]]:
        """Decode ``requests`` (one sampling setting) as one left-padded batch: (tokens, log-probs, aborted) each."""
        sampling = requests[0].sampling
        rows = len(requests)
        # a prompt's n responses share its prefill: each distinct prompt runs once, its cache rows are then repeated
        distinct = list(dict.fromkeys(tuple(request.prompt_ids) for request in requests))
        row_of_prompt = {prompt: row for row, prompt in enumerate(distinct)}
        width = max(map(len, distinct))
        input_ids = torch.zeros(len(distinct), width, dtype=torch.long)
        attention_mask = torch.zeros(len(distinct), width, dtype=torch.long)
        for row, prompt in enumerate(distinct):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt):] = 1
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        tokens: list[list[int]] = [[] for _ in requests]
        log_probs: list[list[float]] = [[] for _ in requests]
        aborted = [False] * rows
        active = list(range(rows))  # the requests still decoding, in the order of the batch's rows
        with self._model_lock, torch.inference_mode():
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=True,
                             logits_to_keep=1)
            expand = torch.tensor([row_of_prompt[tuple(request.prompt_ids)] for request in requests])
            past = out.past_key_values
            past.reorder_cache(expand)
            logits, attention_mask, positions = out.logits[expand, -1], attention_mask[expand], positions[expand]
            while active:
                sampled, sampled_log_probs = sample_next_tokens(logits, sampling.temperature, sampling.top_k,
                                                                sampling.top_p, self._generator)
                keep = []
                for row, index in enumerate(active):
                    token = int(sampled[row])
                    tokens[index].append(token)
                    log_probs[index].append(float(sampled_log_probs[row]))
                    ended = token in self.eos_token_ids and not sampling.ignore_eos
                    if not ended and len(tokens[index]) < requests[index].max_tokens:
                        if self._abort_epoch != requests[index].epoch:
                            aborted[index] = True
                        else:
                            keep.append(row)
                if len(keep) < len(active):
                    if not keep:
                        break
                    kept = torch.tensor(keep)
                    past.reorder_cache(kept)
                    sampled, attention_mask, positions = sampled[kept], attention_mask[kept], positions[kept]
                    active = [active[row] for row in keep]
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(active), 1)], dim=1)
                positions = positions[:, -1:] + 1
                logits = self.model(input_ids=sampled[:, None], attention_mask=attention_mask, position_ids=positions,
                                    past_key_values=past, use_cache=True).logits[:, -1]
        return [(tokens[i], log_probs[i], aborted[i]) for i in range(rows)]

    async def _run_decoder(self) -> None:
        """Take the oldest request and those that arrive with it (same sampling, up to ``max_batch``) and decode them
        as one batch, until the queue is empty."""
        arrival = self._arrival
        while self._queue:
            while True:  # admission: wait while requests keep arriving
                arrival.clear()
                try:
                    await asyncio.wait_for(arrival.wait(), self.ADMISSION_WAIT_S)
                except asyncio.TimeoutError:
                    break
                if len(self._queue) >= self.max_batch:
                    break
            sampling = self._queue[0].sampling
            batch = [request for request in self._queue if request.sampling == sampling][: self.max_batch]
            taken = {id(request) for request in batch}
            self._queue = [request for request in self._queue if id(request) not in taken]
            stale = [request for request in batch if request.epoch != self._abort_epoch]
            for request in stale:  # aborted while queued: nothing sampled
                request.result.set_result(([], [], True))
            batch = [request for request in batch if request.epoch == self._abort_epoch]
            if not batch:
                continue
            try:
                results = await asyncio.to_thread(self._decode_batch, batch)
            except Exception as error:  # every request of the batch fails with the error, the server keeps serving
                for request in batch:
                    request.result.set_exception(error)
                continue
            for request, result in zip(batch, results, strict=True):
                request.result.set_result(result)
        self._decoder = None

    def _max_tokens(self, prompt_len: int, sampling_params: dict[str, Any]) -> int:
        max_model_len = _get(self.config, "max_model_len", None) or (
            int(_get(self.config, "prompt_length")) + int(_get(self.config, "response_length"))
        )
        room = int(max_model_len) - prompt_len
        if room < 1:
            raise ValueError(f"Prompt length ({prompt_len}) leaves no room to generate within {max_model_len} tokens")
        if "max_tokens" in sampling_params:
            wanted = sampling_params.pop("max_tokens")
        elif "max_new_tokens" in sampling_params:
            wanted = sampling_params.pop("max_new_tokens")
        else:
            response_length, prompt_length = (
                int(_get(self.config, "response_length")),
                int(_get(self.config, "prompt_length")),
            )
            wanted = min(response_length, prompt_length + response_length - prompt_len)
        return max(1, min(int(wanted), room))

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Any = None,
        video_data: Any = None,
        **_: Any,
    ) -> TokenOutput:
        if image_data is not None or video_data is not None:
            raise NotImplementedError("the hf CPU rollout is text-only")
        sampling_params = dict(sampling_params)
        want_log_probs = bool(sampling_params.pop("logprobs", False))
        prompt_ids = [int(t) for t in (prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else prompt_ids)]
        max_tokens = self._max_tokens(len(prompt_ids), sampling_params)

        while self._submission_paused:
            if self._rejecting:
                return TokenOutput(
                    token_ids=[], stop_reason="aborted", extra_fields={"global_steps": self.global_steps}
                )
            await self._events().wait()
        self._in_flight += 1
        try:
            steps = self.global_steps
            request = _Request(prompt_ids, max_tokens, Sampling.of(sampling_params), self._abort_epoch,
                               asyncio.get_running_loop().create_future())
            self._queue.append(request)
            if self._loop is not asyncio.get_running_loop():  # the decoder and its event belong to one event loop
                self._loop, self._arrival, self._decoder = asyncio.get_running_loop(), asyncio.Event(), None
            self._arrival.set()
            if self._decoder is None:
                self._decoder = asyncio.create_task(self._run_decoder())
            tokens, log_probs, aborted = await request.result
        finally:
            self._in_flight -= 1
        return TokenOutput(
            token_ids=tokens,
            log_probs=log_probs if want_log_probs else None,
            stop_reason="aborted" if aborted else "completed",
            extra_fields={"global_steps": steps, "num_cached_tokens": 0},
        )

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: list[tuple[str, torch.Tensor]], global_steps: int | None = None) -> int:
        """Load full tensors (HF parameter names) into the model; returns how many were loaded.

        A sync is the whole model (verl's checkpoint engines send every parameter each time): a parameter
        the trainer did not send (a weight-name mapping that lost it, e.g. Megatron's exporter) raises rather
        than leaving the rollout on a stale copy of it."""
        # state_dict names include tied weights (lm_head.weight shares embed_tokens.weight).
        targets = self.model.state_dict(keep_vars=True)
        received: set[int] = set()
        loaded = 0
        with self._model_lock, torch.no_grad():
            for name, tensor in named_tensors:
                target = targets.get(name)
                if target is None:
                    raise KeyError(f"hf rollout: the trainer sent weight {name!r}, which the rollout model lacks")
                if target.shape != tensor.shape:
                    raise ValueError(f"hf rollout: weight {name!r} of shape {tuple(tensor.shape)}, the model's is {tuple(target.shape)}")
                target.copy_(tensor.to(dtype=target.dtype))
                received.add(id(target))
                loaded += 1
        # named_parameters lists a tied parameter once, under whichever name it has first
        missing = [name for name, param in self.model.named_parameters() if id(param) not in received]
        if missing:
            raise KeyError(f"hf rollout: the trainer's weight sync lacks {len(missing)} parameter(s) of the model: {missing[:8]}")
        self._weights_version += 1
        if global_steps is not None:
            self.global_steps = global_steps
        return loaded

    def weights_version(self) -> int:
        return self._weights_version

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    # ------------------------------------------------------------------ verl's server control surface
    async def wake_up(self, tags: list[str] | None = None) -> None:
        return None

    async def sleep(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def start_profile(self, **_: Any) -> None:
        return None

    async def stop_profile(self) -> None:
        return None

    async def wait_for_requests_to_drain(self) -> None:
        while self._in_flight > 0:
            await asyncio.sleep(0.01)

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict[str, Any]:
        self._submission_paused = True
        self._rejecting = reject_request
        self._events().clear()
        aborted = self._in_flight
        self._abort_epoch += 1
        await self.wait_for_requests_to_drain()
        return {"aborted_count": aborted, "request_ids": []}

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict[str, Any]:
        return {"aborted": False, "request_id": request_id}

    async def resume_generation(self) -> None:
        self._rejecting = False
        self._submission_paused = False
        self._events().set()

    resume_engine_generation = resume_generation
    open_submission_gate = resume_generation


async def unfinished_train_prompts() -> dict[int, int]:
    """The training prompts verl has submitted whose response groups are not all in, by the step that submitted them
    (TransferQueue's prompt tags, which verl's replay buffer reads); empty where TransferQueue is not running."""
    import transfer_queue as tq

    try:
        listed = await tq.async_kv_list("train")
    except Exception:  # no TransferQueue in this process (the server used on its own, in tests)
        return {}
    counts: dict[int, int] = {}
    for tag in (listed or {}).get("train", {}).values():
        if tag.get("is_prompt") and tag.get("status") in ("pending", "running"):
            counts[tag["global_steps"]] = counts.get(tag["global_steps"], 0) + 1
    return counts


class HFReplica(RolloutReplica):
    """Rollout replica whose server is one :class:`HFRolloutServer` actor (no GPU, no port).

    A weight sync waits until every submitted training prompt is answered (:meth:`abort_all_requests`): verl's
    ``separate_async`` trainer otherwise aborts what is in flight and samples it again on the new weights, so the
    lag that runs depends on the sampler's speed. With the wait, the batch submitted at step t is sampled whole by
    the weights of step t - 1, and with ``num_warmup_batches`` = k the batch trained at step n > k + 1 is exactly k
    syncs old (PipelineRL-k), whatever the relative speeds; a slow sampler makes the trainer wait instead
    (``timing_s/update_weights``). In the synchronous trainer nothing is in flight at a sync, and it waits for nothing.
    """

    DRAIN_POLL_S = 0.05
    DRAIN_TIMEOUT_S = 1800.0  # far above a step's generation (seconds); reached only when nothing will answer

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self) -> None:
        if self.nnodes != 1:
            raise NotImplementedError(f"the hf CPU rollout runs on one node, got nnodes={self.nnodes}")
        if self.is_reward_model:
            name = f"{SERVER_PREFIX}server_reward_{self.replica_rank}_0{self.name_suffix}"
        elif self.is_teacher_model:
            name = f"{SERVER_PREFIX}server_teacher_{self.replica_rank}_0{self.name_suffix}"
        else:
            name = server_actor_name(self.replica_rank) + self.name_suffix
        server_cls = ray.remote(HFRolloutServer)
        server = server_cls.options(
            name=name,
            num_cpus=0,
            max_concurrency=self.max_concurrency,
            runtime_env={"env_vars": {"VERL_PLATFORM": os.environ.get("VERL_PLATFORM", "cpu")}},
        ).remote(
            config=self.config,
            model_config=self.model_config,
            rollout_mode=self.rollout_mode,
            replica_rank=self.replica_rank,
            node_rank=0,
        )
        await server.launch_server.remote()
        self.servers = [server]
        address, port = await server.get_server_address.remote()
        self._server_handle = server
        self._server_address = f"{address}:{port}"

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        started = time.perf_counter()
        while unfinished := await unfinished_train_prompts():
            if time.perf_counter() - started > self.DRAIN_TIMEOUT_S:  # nothing answers them (a worker died): go on
                logger.warning("hf replica %d: %s training prompts (by submitting step) still unanswered after %.0f s; "
                               "aborting them, so this sync does not hold the lag", self.replica_rank, unfinished,
                               self.DRAIN_TIMEOUT_S)
                break
            await asyncio.sleep(self.DRAIN_POLL_S)
        logger.info("hf replica %d: %.2f s waiting for the submitted prompts before a weight sync", self.replica_rank,
                    time.perf_counter() - started)
        await super().abort_all_requests(reject_request=reject_request)


class HFServerAdapter(BaseRollout):
    """The rollout object in the hybrid actor worker: forwards weight syncs to the replica's server.

    verl's naive weight sync (``ActorRolloutRefWorker.update_weights``) calls ``resume`` / ``update_weights``
    here with the trainer's full per-tensor parameters (HF names). Rank 0 of each replica gathers them on the
    host and sends one batch to ``hf_server_<replica>_0``; other ranks only drain the generator.
    """

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1, **_: Any) -> None:
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        rollout_world_size = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // rollout_world_size if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % rollout_world_size
        self.server_handle = None

    @property
    def is_leader_rank(self) -> bool:
        return self.rollout_rank == 0

    def _server(self):
        if self.rollout_rank != 0:
            return None
        if self.server_handle is None:
            self.server_handle = ray.get_actor(server_actor_name(self.replica_rank))
        return self.server_handle

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    @torch.no_grad()
    async def update_weights(
        self,
        weights: Generator[tuple[str, torch.Tensor], None, None] | Iterable,
        wire_format: str = "named_tensors",
        global_steps: int | None = None,
        **kwargs: Any,
    ) -> None:
        if wire_format != "named_tensors":
            raise NotImplementedError(f"the hf CPU rollout takes wire_format='named_tensors', got {wire_format!r}")
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError("the hf CPU rollout does not take LoRA adapters (use model.lora.merge=true)")
        named = await host_named_tensors(weights)
        server = self._server()
        if server is not None:
            await server.update_weights.remote(named, global_steps)


require("cpu_rollout")
RolloutReplicaRegistry.register(ROLLOUT_NAME, lambda: HFReplica)
rollout_base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = f"{__name__}.HFServerAdapter"

"""Hugging Face transformers: a causal LM that reuses prompt-prefix KV through the kvtier daemon.

`KvtierGenerator(model, client)` wraps `model.generate` for batch size 1. Before a prompt runs it
looks up the prompt's chained prefix keys (`kvtier.keys.prefix_keys`, full pages only), recalls
the pages the node holds into a shared-memory pool and turns them into a `DynamicCache`, so
`generate` prefills only the tokens after the reused prefix. After generation it stores the
prompt's full pages the daemon did not hold yet. A page that fails to recall (corrupt on disk,
evicted between lookup and recall) cuts the reused prefix just before it: the rest is recomputed.

Verbs: `KvtierGenerator.generate`, `KvtierGenerator.prepare_cache`, `KvtierGenerator.store_prompt`,
`KvtierGenerator.close`; `namespace_for` names a model's pages. Only this module imports torch.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache, GenerationMixin, PreTrainedModel

from kvtier.client import Client, JobResult, PoolHandle, SharedPool
from kvtier.keys import Namespace, prefix_keys
from kvtier.pools.layout import PoolLayout

LAYOUT = "page-first/hf"  # [page][layer][K, V][token][kv head][dim], the pool's own order

_TORCH_TO_DTYPE = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass(slots=True, frozen=True)
class ReuseReport:
    """What one prompt reused from and gave back to the daemon.

    Attributes:
        num_prompt_tokens: tokens in the prompt.
        num_reused_tokens: prompt tokens whose KV came from the daemon instead of a forward pass.
        num_stored_pages: prompt pages stored to the daemon after generation.
        reused_tiers: for each reused page, the tier it was served from ("host", "disk").
        recall_problems: one sentence per page that was found but could not be recalled.
        store_problems: one sentence per page the daemon failed to store.
    """

    num_prompt_tokens: int
    num_reused_tokens: int
    num_stored_pages: int
    reused_tiers: tuple[str | None, ...]
    recall_problems: tuple[str, ...]
    store_problems: tuple[str, ...]

    @property
    def num_computed_tokens(self) -> int:
        """Prompt tokens the model prefilled itself."""
        return self.num_prompt_tokens - self.num_reused_tokens


@dataclass(slots=True, frozen=True)
class PreparedPrompt:
    """A prompt's keys and the cache holding its reused prefix, between recall and store."""

    token_ids: np.ndarray
    keys: list[bytes]
    cache: DynamicCache
    num_reused_pages: int
    present_pages: frozenset[int]  # pages the daemon already holds intact: not stored again
    reused_tiers: tuple[str | None, ...]
    recall_problems: tuple[str, ...]


def namespace_for(model: PreTrainedModel, page_tokens: int,
                  model_id: str | None = None) -> Namespace:
    """The namespace of `model`'s KV pages.

    The model id is `model_id`, else the model's `name_or_path`, followed by a hash of its config,
    so two models that differ in any config field never share pages. Weights are not hashed:
    pass `model_id` when the same name and config can hold different weights (a fine-tune in
    place, a randomly initialised model).
    """
    config = model.config
    config_hash = hashlib.blake2b(config.to_json_string(use_diff=False).encode(),
                                  digest_size=8).hexdigest()
    name = model_id or getattr(config, "name_or_path", "") or config.model_type
    num_layers, num_kv_heads, head_dim = _kv_shape(model)
    layout = PoolLayout.page_first(1, num_layers, page_tokens, num_kv_heads, head_dim,
                                   _dtype_name(model))
    return Namespace(f"{name}#{config_hash}", layout.dtype, LAYOUT, page_tokens, layout.page_bytes)


def _dtype_name(model: PreTrainedModel) -> str:
    name = _TORCH_TO_DTYPE.get(model.dtype)
    if name is None:
        raise ValueError(f"KV dtype {model.dtype} is not supported; use one of "
                         f"{', '.join(map(str, _TORCH_TO_DTYPE))}")
    return name


def _kv_shape(model: PreTrainedModel) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) of a decoder with one full-attention cache per layer."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("encoder-decoder models are not supported: only decoder-only causal LMs")
    if getattr(config, "sliding_window", None) is not None or any(
            kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        raise ValueError("models with sliding-window or non-standard attention layers are not "
                         "supported: their cache does not hold every prompt token")
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return config.num_hidden_layers, num_kv_heads, head_dim


def _layer_kv(cache: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one layer, `[batch, kv heads, tokens, dim]`, across cache API versions."""
    layers = getattr(cache, "layers", None)
    if layers is not None:  # transformers >= 4.56
        return layers[layer].keys, layers[layer].values
    # transformers < 4.56: attributes the installed release's annotations no longer declare.
    return getattr(cache, "key_cache")[layer], getattr(cache, "value_cache")[layer]


def _failed_indices(keys: Sequence[bytes], result: JobResult) -> list[int]:
    """Indices of the keys a recall did not deliver, in order."""
    bad = set(result.failed) | set(result.missing)
    return [i for i, key in enumerate(keys) if key in bad]


def _runs(page_indices: Sequence[int], max_len: int) -> list[list[int]]:
    """Split sorted page indices into runs of consecutive pages, each at most `max_len` long."""
    runs: list[list[int]] = []
    for index in page_indices:
        if runs and runs[-1][-1] == index - 1 and len(runs[-1]) < max_len:
            runs[-1].append(index)
        else:
            runs.append([index])
    return runs


class KvtierGenerator:
    """Greedy (or sampled) `generate` for one prompt at a time, reusing prefix KV through kvtier.

    Args:
        model: a decoder-only transformers model with a `DynamicCache` of one full-attention
            layer per decoder layer (Llama, Mistral without sliding window, Qwen2, ...).
        client: a connected `Client`, or the daemon's socket path (None: the default socket);
            a client this object opens, it closes.
        page_tokens: tokens per page.
        num_pool_pages: pages in the shared-memory pool; longer prompts move in several rounds.
        model_id: names the weights (see `namespace_for`).

    Raises:
        ValueError: the model's cache or dtype is not supported (the message says which).
        ConnectionError: no daemon listens on the socket.
    """

    def __init__(self, model: PreTrainedModel, client: Client | str | Path | None = None, *,
                 page_tokens: int = 16, num_pool_pages: int = 256,
                 model_id: str | None = None) -> None:
        if not isinstance(model, GenerationMixin):
            raise ValueError(f"{type(model).__name__} cannot generate: use a causal LM "
                             "(a ...ForCausalLM class)")
        self.model = model
        self._generator: GenerationMixin = model
        self._num_layers, self._num_kv_heads, self._head_dim = _kv_shape(model)
        self._torch_dtype = model.dtype
        self.namespace = namespace_for(model, page_tokens, model_id)
        self.page_tokens = page_tokens
        # transformers 5 renamed generate's `past_key_values` to `cache`.
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.client: Client
        if isinstance(client, Client):
            self.client, self._owns_client = client, False
        else:
            self.client, self._owns_client = Client(client, "kvtier-transformers"), True
        layout = PoolLayout.page_first(num_pool_pages, self._num_layers, page_tokens,
                                       self._num_kv_heads, self._head_dim, self.namespace.dtype)
        try:
            self.pool = SharedPool(layout)
        except BaseException:
            self._close_client()
            raise
        try:
            self.pool_handle: PoolHandle = self.pool.register(self.client, self.namespace)
        except BaseException:
            self.pool.close()
            self._close_client()
            raise
        self.last_report: ReuseReport | None = None
        self._closed = False

    def _pool_kv(self, num_pages: int) -> torch.Tensor:
        """Pool pages [0, num_pages) as a `[pages, layers, 2, tokens, kv heads, dim]` view."""
        raw = torch.from_numpy(self.pool.pages[:num_pages])
        return raw.view(self._torch_dtype).view(num_pages, self._num_layers, 2, self.page_tokens,
                                                self._num_kv_heads, self._head_dim)

    def _prompt_tokens(self, input_ids: torch.Tensor) -> np.ndarray:
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must have shape [1, tokens] (batch size 1), "
                             f"got {list(input_ids.shape)}")
        return input_ids[0].cpu().numpy().astype(np.int64)

    def prepare_cache(self, input_ids: torch.Tensor) -> PreparedPrompt:
        """Recall the longest stored prefix of the prompt into a fresh `DynamicCache`.

        At most `(tokens - 1) // page_tokens` pages are reused: the model must still run the last
        prompt token to produce the first new token's logits.
        """
        token_ids = self._prompt_tokens(input_ids)
        keys = prefix_keys(self.namespace, token_ids)
        lookup = self.client.lookup(self.pool_handle, keys)
        present = {i for i, tier in enumerate(lookup.tiers) if tier is not None}
        num_wanted = min(lookup.num_prefix, (len(token_ids) - 1) // self.page_tokens)
        num_pool_pages = self.pool.layout.num_pages
        kv_parts: list[torch.Tensor] = []
        tiers: list[str | None] = []
        problems: list[str] = []
        for start in range(0, num_wanted, num_pool_pages):
            run_keys = keys[start : min(num_wanted, start + num_pool_pages)]
            result = self.client.recall(self.pool_handle, run_keys, range(len(run_keys))).result()
            failed = _failed_indices(run_keys, result)
            present.difference_update(start + i for i in failed)  # the daemon dropped them
            num_good = failed[0] if failed else len(run_keys)
            if num_good:
                kv = torch.empty((self._num_layers, 2, self._num_kv_heads, num_good,
                                  self.page_tokens, self._head_dim), dtype=self._torch_dtype)
                # One copy out of the pool: the pool pages are reused by the next recall or store.
                kv.copy_(self._pool_kv(num_good).permute(1, 2, 4, 0, 3, 5))
                kv_parts.append(kv)
                tiers.extend(result.tiers[:num_good])
            if num_good < len(run_keys):
                bad = run_keys[num_good]
                why = result.failed.get(bad, "missing at recall")
                problems.append(f"page {start + num_good} ({bad.hex()}): {why}")
                break
        cache = DynamicCache()
        if kv_parts:
            kv = torch.cat(kv_parts, dim=3).to(self.model.device)
            num_tokens = kv.shape[3] * self.page_tokens
            kv = kv.view(self._num_layers, 2, self._num_kv_heads, num_tokens, self._head_dim)
            for layer in range(self._num_layers):
                cache.update(kv[layer, 0].unsqueeze(0), kv[layer, 1].unsqueeze(0), layer)
        num_reused = sum(part.shape[3] for part in kv_parts)
        return PreparedPrompt(token_ids, keys, cache, num_reused, frozenset(present),
                              tuple(tiers), tuple(problems))

    def store_prompt(self, prepared: PreparedPrompt) -> tuple[int, list[str]]:
        """Store the prompt's full pages the daemon lacks, from the cache after a forward pass.

        Returns:
            (pages stored, one sentence per page that failed).
        """
        to_store = [i for i in range(len(prepared.keys)) if i not in prepared.present_pages]
        if not to_store:
            return 0, []
        num_tokens = len(prepared.keys) * self.page_tokens
        with torch.no_grad():
            layers = []
            for layer in range(self._num_layers):
                k, v = _layer_kv(prepared.cache, layer)
                expected = (1, self._num_kv_heads, k.shape[2], self._head_dim)
                if tuple(k.shape) != expected or k.shape[2] < num_tokens:
                    raise ValueError(f"layer {layer} cache has shape {list(k.shape)}, expected "
                                     f"[1, {self._num_kv_heads}, >= {num_tokens}, "
                                     f"{self._head_dim}]")
                layers.append(torch.stack((k[0, :, :num_tokens], v[0, :, :num_tokens])))
            kv = torch.stack(layers).to("cpu", self._torch_dtype).view(
                self._num_layers, 2, self._num_kv_heads, len(prepared.keys), self.page_tokens,
                self._head_dim)
            num_stored = 0
            problems: list[str] = []
            for run in _runs(to_store, self.pool.layout.num_pages):
                self._pool_kv(len(run)).copy_(kv[:, :, :, run].permute(3, 0, 1, 4, 2, 5))
                run_keys = [prepared.keys[i] for i in run]
                parent = prepared.keys[run[0] - 1] if run[0] > 0 else None
                result = self.client.store(self.pool_handle, run_keys, range(len(run)),
                                           parent_key=parent).result()
                num_stored += result.num_done
                problems.extend(f"page {run[run_keys.index(key)]} ({key.hex()}): {why}"
                                for key, why in result.failed.items())
        return num_stored, problems

    def generate(self, input_ids: torch.Tensor, **generate_kwargs: Any) -> Any:
        """`model.generate(input_ids, **generate_kwargs)`, prefilling only what kvtier lacks.

        Returns what `model.generate` returns; `last_report` says what was reused and stored.

        Raises:
            ValueError: batch size above 1, beam search, several return sequences, padding, or a
                cache passed by the caller.
        """
        for name in ("cache", "past_key_values", "inputs_embeds"):
            if generate_kwargs.get(name) is not None:
                raise ValueError(f"{name} is not supported: KvtierGenerator builds the cache")
        config = self.model.generation_config
        if generate_kwargs.get("num_beams", config.num_beams or 1) > 1:
            raise ValueError("beam search is not supported; use num_beams=1")
        if generate_kwargs.get("num_return_sequences", config.num_return_sequences or 1) > 1:
            raise ValueError("num_return_sequences above 1 is not supported")
        mask = generate_kwargs.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise ValueError("padded prompts are not supported: the attention mask must be all "
                             "ones")
        prepared = self.prepare_cache(input_ids)
        output = self._generator.generate(input_ids, **{self._cache_kwarg: prepared.cache},
                                          **generate_kwargs)
        num_stored, store_problems = self.store_prompt(prepared)
        self.last_report = ReuseReport(
            num_prompt_tokens=len(prepared.token_ids),
            num_reused_tokens=prepared.num_reused_pages * self.page_tokens,
            num_stored_pages=num_stored, reused_tiers=prepared.reused_tiers,
            recall_problems=prepared.recall_problems, store_problems=tuple(store_problems))
        return output

    def close(self) -> None:
        """Unregister and unlink the pool; close the client if this object opened it."""
        if self._closed:
            return
        self._closed = True
        try:
            self.client.unregister_pool(self.pool_handle)
        finally:
            self.pool.close()
            self._close_client()

    def _close_client(self) -> None:
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> KvtierGenerator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

"""The demo's model workload: a small Llama answers prompts that share a long system prompt.

Each prompt runs twice, plainly and through `KvtierGenerator`, to time the first token both ways
and to check the generated tokens are identical. The model is built from a config with a fixed
seed (no download). Verbs: `build_demo_model`, `run_model_demo`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvtier.client import Client
from kvtier.integrations.transformers import KvtierGenerator


@dataclass(slots=True, frozen=True)
class PromptFigures:
    """One prompt of the demo, without and with kvtier."""

    prompt_tokens: int
    reused_tokens: int
    ttft_plain_ms: float
    ttft_kvtier_ms: float
    same_tokens: bool


def build_demo_model(seed: int = 0) -> LlamaForCausalLM:
    """An 8-layer Llama with grouped-query attention, random weights from `seed`, float32."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024,
                         num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=4096)
    return LlamaForCausalLM(config).eval()


def _first_token_ms(generate: Callable[[], object]) -> float:
    started = time.perf_counter()
    generate()
    return (time.perf_counter() - started) * 1e3


@torch.inference_mode()
def run_model_demo(client: Client, num_prompts: int = 6, system_tokens: int = 1024,
                   new_tokens: int = 16, seed: int = 0,
                   on_prompt: Callable[[PromptFigures], None] | None = None
                   ) -> list[PromptFigures]:
    """Answer `num_prompts` prompts sharing a system prompt of `system_tokens` tokens;
    `on_prompt` gets each prompt's figures as soon as they are measured."""
    model = build_demo_model(seed)
    generator = torch.Generator().manual_seed(seed)
    system = torch.randint(0, 4096, (system_tokens,), generator=generator)
    model.generate(system[:64].unsqueeze(0), max_new_tokens=1, do_sample=False,
                   pad_token_id=0)  # warm-up: first-call costs are not prefill
    figures = []
    with KvtierGenerator(model, client, num_pool_pages=(system_tokens + 256) // 16 + 8,
                         model_id="kvtier-demo/llama-8l") as kvtier_model:
        for index in range(num_prompts):
            question = torch.randint(0, 4096, (48 + 16 * index,), generator=generator)
            prompt = torch.cat([system, question]).unsqueeze(0)
            greedy = {"do_sample": False, "pad_token_id": 0}
            plain_ms = _first_token_ms(partial(model.generate, prompt, max_new_tokens=1,
                                               **greedy))
            kvtier_ms = _first_token_ms(partial(kvtier_model.generate, prompt, max_new_tokens=1,
                                                **greedy))
            report = kvtier_model.last_report
            assert report is not None  # the generate just above set it
            reused = report.num_reused_tokens
            plain = model.generate(prompt, max_new_tokens=new_tokens, **greedy)
            through_kvtier = kvtier_model.generate(prompt, max_new_tokens=new_tokens, **greedy)
            figures.append(PromptFigures(prompt.shape[1], reused, plain_ms, kvtier_ms,
                                         bool(torch.equal(plain, through_kvtier))))
            if on_prompt is not None:
                on_prompt(figures[-1])
    return figures

"""Engine integrations: adapters that let an inference engine keep its KV pages in kvtier.

Each submodule belongs to one engine and is the only place that engine's packages (torch,
transformers, ...) are imported; importing `kvtier` itself never pulls them in. Submodules:

- `kvtier.integrations.transformers`: Hugging Face causal LMs reuse prompt-prefix KV through the
  daemon (`pip install "kvtier[transformers]"`).
- `kvtier.integrations.vllm`: a KV connector for vLLM's v1 engine.
- `kvtier.integrations.sglang`: an L3 storage backend for SGLang's HiCache.
"""

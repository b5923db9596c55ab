"""Offline inference on the default model (SmolLM2-135M-Instruct), with and without vToken.

    python examples/offline_inference.py
"""
from vllm import LLM, SamplingParams

prompts = ["The capital of France is", "A haiku about paged attention:"]
params = SamplingParams(temperature=0.0, max_tokens=48)

# Native: full KV retention.
llm = LLM(max_model_len=2048)
for out in llm.generate(prompts, params):
    print(repr(out.prompt), "->", repr(out.outputs[0].text))

print(llm.chat([{"role": "user", "content": "Name three primary colors."}], params)[0].outputs[0].text)

# H2O keeps half of the tokens; vToken repacks the survivors so emptied blocks return to the pool.
llm = LLM(max_model_len=2048, kv_eviction_policy="h2o", kv_eviction_ratio=0.5,
          kv_reclamation="vtoken")
out = llm.generate(["Write a short story about a lighthouse keeper. " * 8], params)[0]
print(out.outputs[0].text)
print("per-request KV:", out.kv_stats)
print("engine KV:", llm.get_kv_stats())

"""Bounded load: 64 concurrent streaming requests of mixed lengths, a quarter of which disconnect
early. The rest complete with exact token counts; afterwards the engine holds nothing."""
import asyncio
import random

import httpx
import openai
import pytest

from tests.server_utils import serve, wait_until_clean

N_REQUESTS = 64
LONG = 900          # what a disconnecting request asks for: it would run for seconds if not aborted


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{"))


async def _one(client, i: int, rng: random.Random):
    words = " ".join(f"w{rng.randrange(3, 512)}" for _ in range(rng.randrange(3, 40)))
    drop = i % 4 == 3
    max_tokens = LONG if drop else rng.choice([8, 16, 32, 64])
    stream = await client.completions.create(
        model="tiny", prompt=words, max_tokens=max_tokens, temperature=0.8, seed=i, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    token_chunks, usage, finish = 0, None, None
    async with stream:
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices:
                token_chunks += 1
                finish = chunk.choices[0].finish_reason or finish
            if drop and token_chunks == 2:
                break            # leaving the context manager closes the connection
    return drop, max_tokens, token_chunks, usage, finish


@pytest.mark.parametrize("flags", [{}, {"kv_eviction_policy": "h2o", "kv_reclamation": "vtoken",
                                        "block_size": 8, "kv_min_tokens": 0}], ids=["native", "h2o-vtoken"])
def test_concurrent_streams_with_disconnects(tiny_llama, flags):
    engine, srv = serve(tiny_llama, num_gpu_blocks_override=1536 // flags.get("block_size", 16),
                        **flags)
    with srv:
        before = httpx.get(srv.url + "/metrics").text

        async def run():
            client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0,
                                        timeout=120)
            rng = random.Random(0)
            try:
                return await asyncio.gather(*[_one(client, i, rng) for i in range(N_REQUESTS)])
            finally:
                await client.close()

        results = asyncio.run(run())
        wait_until_clean(engine, timeout=30)
        after = httpx.get(srv.url + "/metrics").text

    completed = [r for r in results if not r[0]]
    assert len(completed) == N_REQUESTS * 3 // 4
    for _, max_tokens, chunks, usage, finish in completed:
        assert usage.completion_tokens == max_tokens and chunks == max_tokens
        assert finish == "length"
    generated = _metric(after, "vllm:generation_tokens_total") - \
        _metric(before, "vllm:generation_tokens_total")
    expected = sum(r[1] for r in completed)
    # the disconnected quarter was aborted long before LONG tokens each
    assert expected <= generated < expected + (N_REQUESTS // 4) * LONG // 4
    finished = _metric(after, "vllm:request_success_total") - \
        _metric(before, "vllm:request_success_total")
    assert finished == len(completed)

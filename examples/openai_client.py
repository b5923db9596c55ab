"""Talk to `vllm serve` with the official openai client.

Start a server (vToken + H2O on the default model) in another shell:

    make serve                      # or: vllm serve --kv-eviction-policy h2o --kv-reclamation vtoken

then run `python examples/openai_client.py [--base-url http://127.0.0.1:8000/v1]`.

The same with curl:

    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 32}'
    curl http://127.0.0.1:8000/metrics | grep -E 'vllm:(kv_|num_requests)'
"""
import argparse

from openai import OpenAI


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="EMPTY", help="the server's --api-key, if set")
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    print(f"model: {model}")

    # Completion, greedy, with the top-2 logprobs of each token.
    out = client.completions.create(model=model, prompt="The capital of France is",
                                    max_tokens=8, temperature=0, logprobs=2)
    print("completion:", repr(out.choices[0].text), "| tokens:", out.choices[0].logprobs.tokens)

    # Chat; upstream's sampling extensions go in extra_body.
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name three colors."}],
        max_tokens=32, temperature=0.7, seed=0, extra_body={"top_k": 40, "min_p": 0.05})
    print("chat:", chat.choices[0].message.content, "| usage:", chat.usage)

    # Streaming chat, with a final usage chunk.
    print("stream: ", end="", flush=True)
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count from one to five."}],
        max_tokens=32, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
        elif chunk.usage:
            print(f"\n({chunk.usage.completion_tokens} tokens)")


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# Build the Dockerfile's CPU image without a Docker daemon (buildah, vfs storage, chroot
# isolation), start the server inside it on the host's loopback, and query it with the openai
# client. Prints the time of every stage.
#
#   bash tests/docker/build_and_smoke.sh
#
# The base image is a Python 3.11 Debian bookworm made locally with debootstrap (no registry
# pull); the torch CPU wheel comes from the local pip cache / find-links into build/docker-wheels.
# Environment: IMAGE, BASE_IMAGE, PORT, PYTHON (has openai), WORK (scratch dir), KEEP_IMAGE=1.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${WORK:-/tmp/vllm-docker}
IMAGE=${IMAGE:-localhost/vllm-cpu:smoke}
BASE_IMAGE=${BASE_IMAGE:-localhost/vllm-base:bookworm-py311}
PORT=${PORT:-18123}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
WHEELS=build/docker-wheels
CERTS=build/docker-certs
BUILDAH=(buildah --storage-driver vfs)

T0=$(date +%s)
LAST=$T0
stage() {   # stage NAME: prints the time since the previous stage
    local now; now=$(date +%s)
    printf '[smoke] %-28s %4ds (total %4ds)\n' "$1" $((now - LAST)) $((now - T0))
    LAST=$now
}

if ! command -v buildah >/dev/null || ! command -v debootstrap >/dev/null; then
    apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q buildah debootstrap
    stage "install buildah"
fi
mkdir -p "$WORK"

# 1. A Python 3.11 base image from debootstrap (once; reused while it exists).
if ! "${BUILDAH[@]}" inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
    rm -rf "$WORK/rootfs" "$WORK/base"
    mkdir -p "$WORK/base"
    debootstrap --variant=minbase bookworm "$WORK/rootfs" >"$WORK/debootstrap.log" 2>&1
    tar -C "$WORK/rootfs" -cf "$WORK/base/rootfs.tar" .
    cat >"$WORK/base/Dockerfile" <<'DOCKERFILE'
FROM scratch
ADD rootfs.tar /
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        python3.11 python3.11-venv ca-certificates && rm -rf /var/lib/apt/lists/*
CMD ["/bin/bash"]
DOCKERFILE
    "${BUILDAH[@]}" bud --isolation chroot -q -t "$BASE_IMAGE" "$WORK/base" >/dev/null
    rm -rf "$WORK/rootfs" "$WORK/base"
    stage "base image (debootstrap)"
fi

# 2. The torch CPU wheel, from local disk, into the build context; and the host's CA bundle
#    (pip inside the build may sit behind the same TLS-intercepting proxy as the host).
mkdir -p "$ROOT/$WHEELS" "$ROOT/$CERTS"
"$PYTHON" -m pip download -q torch==2.13.0 --no-deps -d "$ROOT/$WHEELS"
CA_ARG=()
HOST_CA=${HOST_CA:-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}
if [ -f "$HOST_CA" ]; then
    cp "$HOST_CA" "$ROOT/$CERTS/ca-bundle.pem"
    CA_ARG=(--build-arg CA_BUNDLE="$CERTS/ca-bundle.pem")
fi
stage "torch wheel"

# 3. The image.
"${BUILDAH[@]}" bud --isolation chroot --layers=false \
    --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg WHEELS="$WHEELS" \
    --build-arg TORCH_INDEX_URL= "${CA_ARG[@]}" -t "$IMAGE" -f "$ROOT/Dockerfile" "$ROOT" \
    >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; exit 1; }
stage "image build"

# 4. Start the image's ENTRYPOINT + CMD, with the port moved to $PORT, on the host's loopback.
CTR=$("${BUILDAH[@]}" from "$IMAGE")
SERVER_PID=
cleanup() {
    if [ -n "$SERVER_PID" ]; then kill -INT -- "-$SERVER_PID" 2>/dev/null || true; sleep 2; \
        kill -KILL -- "-$SERVER_PID" 2>/dev/null || true; fi
    "${BUILDAH[@]}" rm "$CTR" >/dev/null 2>&1 || true
    if [ -z "${KEEP_IMAGE:-}" ]; then "${BUILDAH[@]}" rmi "$IMAGE" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT
mapfile -t CMDLINE < <("${BUILDAH[@]}" inspect --type image "$IMAGE" | "$PYTHON" -c '
import json, sys
cfg = json.load(sys.stdin)["OCIv1"]["config"]
for a in cfg["Entrypoint"] + (cfg.get("Cmd") or []):
    print(a)')
CMDLINE=("${CMDLINE[@]/0.0.0.0/127.0.0.1}")
CMDLINE=("${CMDLINE[@]/#8000/$PORT}")
echo "[smoke] in the image: ${CMDLINE[*]}"
setsid "${BUILDAH[@]}" run --isolation chroot "$CTR" -- "${CMDLINE[@]}" >"$WORK/server.log" 2>&1 &
SERVER_PID=$!
for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    kill -0 "$SERVER_PID" 2>/dev/null || { tail -40 "$WORK/server.log"; exit 1; }
    sleep 1
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { tail -40 "$WORK/server.log"; exit 1; }
stage "server start in image"

# 5. The openai client against it.
"$PYTHON" - "$PORT" <<'EOF'
import sys
import openai
client = openai.OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="x", max_retries=0)
model = client.models.list().data[0].id
assert model == "SmolLM2-135M-Instruct", model
out = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                temperature=0)
print("[smoke] completion:", repr(out.choices[0].text))
assert out.usage.completion_tokens >= 1
chat = client.chat.completions.create(model=model, max_tokens=16, temperature=0,
                                      messages=[{"role": "user", "content": "Say hello."}])
print("[smoke] chat:", repr(chat.choices[0].message.content))
text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
    model=model, max_tokens=16, stream=True,
    messages=[{"role": "user", "content": "Count to three."}]) if c.choices)
print("[smoke] stream:", repr(text))
assert text
EOF
curl -sf "http://127.0.0.1:$PORT/metrics" | grep -q '^vllm:kv_evicted_tokens_total'
stage "openai client queries"
"${BUILDAH[@]}" images --format '{{.Name}}:{{.Tag}} {{.Size}}' | grep -F "${IMAGE#localhost/}" || true
echo "[smoke] OK"

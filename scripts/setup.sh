#!/usr/bin/env bash
# Create (or update) .venv with lightning_pp, its test and plot extras, and the integrations the
# suite covers at their newest releases: transformers (hf) and litdata. litgpt is not in it: litgpt
# 0.5.13 requires huggingface-hub < 1.4, which current transformers (>= 5.4) exclude; .ci/run tests
# litgpt in a second environment with the oldest supported releases (.ci/oldest.txt).
#
# torch is installed first, pinned, and stays pinned on every pip line, so pip does not pick a
# newer multi-GB CUDA build on a CPU machine: on the project's CPU machines `torch==2.13.0`
# resolves to the CPU wheel on disk; on a GPU machine it is PyPI's usual CUDA build. Override with
# TORCH_SPEC="torch==X.Y"; VENV=path for another environment than .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
venv=${VENV:-.venv}
torch_spec=${TORCH_SPEC:-torch==2.13.0}
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/pip" install -q)
"${pip[@]}" "$torch_spec"
"${pip[@]}" "$torch_spec" -e ".[test,plot,hf]"
# litdata (>= 0.2.45) requires torchvision, which it imports only to (de)serialise images and video.
# PyPI's torchvision wheel does not load beside a CPU build of torch ("operator torchvision::nms
# does not exist"), and torchmetrics, hence Lightning, then fail at import. With a CPU torch, install
# litdata without torchvision (everything else it requires, as its metadata lists it); with a CUDA
# torch, as usual.
if "$venv/bin/python" -c "import sys, torch; sys.exit(torch.version.cuda is None)"; then
    "${pip[@]}" "$torch_spec" "litdata>=0.2.30"
else
    "${pip[@]}" --no-deps "litdata>=0.2.30"
    mapfile -t deps < <("$venv/bin/python" - <<'PY'
from importlib.metadata import requires
from packaging.requirements import Requirement
for line in requires("litdata") or []:
    req = Requirement(line)
    if req.name != "torchvision" and (req.marker is None or req.marker.evaluate({"extra": ""})):
        print(str(req).split(";")[0].strip())
PY
)
    "${pip[@]}" "$torch_spec" "${deps[@]}"
fi

#!/bin/bash
# Fill benchmarks/.wheels (git-ignored) with wheels for Python 3.12 on x86-64 Linux, from pip's cache or index, for
# packages a lent GPU machine lacks; benchmarks/gpu_session.sh installs them there with
# `pip install --no-index --no-deps --target`. Name each package with its version (--no-deps: name its needs too):
#   bash benchmarks/gpu_wheels.sh typer==0.29.2 rich==15.0.0
# With no names it lists what the machine's image lacks of fxpipe's needs for the GPU script: nothing, as read in
# /work/.library/device/KINDS.md (torch, transformers, typer, rich, tabulate, numpy, pytest, pytest-xdist,
# hypothesis are there), and downloads nothing. Then carry ["benchmarks/.wheels"] in the device call; without
# wheels, carry nothing.
set -eu
cd "$(dirname "$0")"
if [ $# -eq 0 ]; then
    echo "the GPU image has every package the GPU script needs; name NAME==VERSION to carry another version"
    exit 0
fi
mkdir -p .wheels
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .wheels "$@"
ls -la .wheels
du -sh .wheels  # the device tool carries at most 64 MiB with the working tree

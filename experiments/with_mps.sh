#!/bin/bash
# Run a command under a private CUDA MPS control daemon, stopped afterwards:
#   bash experiments/with_mps.sh python3 -m pytest ...
# Processes that share a GPU then run their kernels at the same time; without MPS the GPU
# time-slices between them, and persistent kernels that wait for each other across
# processes progress only as the slices alternate (the suspected cause of the mpiexec
# verbs test's timeouts on one GPU).
command -v nvidia-cuda-mps-control >/dev/null || { echo "with_mps: no nvidia-cuda-mps-control"; exit 2; }
export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d)
nvidia-cuda-mps-control -d || { echo "with_mps: the daemon did not start"; exit 2; }
"$@"
rc=$?
echo quit | nvidia-cuda-mps-control
exit $rc

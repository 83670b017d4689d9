#!/usr/bin/env bash
# Run a command as a process that sees a share of the GPU's SMs (the seeds' case: a GPU under
# inductor's 68-SM gate), through the CUDA MPS daemon. The daemon is started here and always
# quit on exit, whatever the command does. The SM count the process sees is printed first (and
# the suite records it as sm_count).
#
#   bash benchmarks/mps.sh 30 python3 benchmarks/suite.py --inductor --out suite-sm38.json   # 38 SMs on an H100/H200
#   bash benchmarks/mps.sh 50 python3 benchmarks/suite.py --inductor --out suite-sm66.json   # about 66
set -uo pipefail
if [ $# -lt 2 ] || ! [[ $1 =~ ^[0-9]+$ ]] || [ "$1" -lt 1 ] || [ "$1" -gt 100 ]; then
  echo "usage: $0 PERCENT COMMAND...   (PERCENT: 1-100, the share of SMs the command's process gets)" >&2
  exit 2
fi
share=$1
shift
cd "$(dirname "$0")/.."
export PYTHONPATH=src
CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/mps-pipe.XXXX)
CUDA_MPS_LOG_DIRECTORY=$(mktemp -d /tmp/mps-log.XXXX)
export CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
nvidia-cuda-mps-control -d || { echo "could not start the MPS daemon" >&2; exit 2; }
trap 'echo quit | nvidia-cuda-mps-control; rm -rf "$CUDA_MPS_PIPE_DIRECTORY"' EXIT
export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$share
python3 -c "import torch; print('MPS share', $share, '%: this process sees',
            torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')" || exit 2
"$@"

# Sourced by the scripts in scripts/gpu: RES = results/<gpu> for this machine's first GPU
# (h200, h100, a100, ... from nvidia-smi; h200 where none is found), exported for the
# Python snippets the scripts run.
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -oi '[ahb][0-9]\{2,3\}' | tr A-Z a-z)
export RES=results/${GPU:-h200}

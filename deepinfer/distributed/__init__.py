"""Several engines over ``torch.distributed`` (NCCL on CUDA with one GPU per rank, gloo on
CPU): ``ranks`` (rank identity, spawn or torchrun launch, group setup and teardown,
failure reporting), ``tp`` (rank layout, DP and TP process groups, TP followers) and
``pd`` (disaggregated prefill/decode: the rounds, which hand finished requests back, and
the KV hand-off). Knows nothing of jobs: the DP and PD jobs (the ``jobs`` package) sit
above it."""

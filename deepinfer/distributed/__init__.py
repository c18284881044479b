"""Several engines over ``torch.distributed`` (NCCL on CUDA with one GPU per rank, gloo on
CPU): ``ranks`` (rank identity, spawn or torchrun launch, group setup and teardown,
failure reporting), ``dp`` (data parallel: one engine per rank, a share of the records
each), ``pd`` (disaggregated prefill/decode: the rounds and the KV hand-off) and
``pd_jobs`` (``--pd`` runs of records, and the library entry ``run_disaggregated``)."""

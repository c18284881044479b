"""Batch jobs: input records, resume, output records, part files and their merge, and the
run summary. Shared by the one-engine, DP and PD runs of ``deepinfer-generate``.

Modules: ``records`` (parse input lines, resolve sampling, write output records),
``resume`` (the one valid-line rule, ids already done, pending records), ``parts`` (per-rank
part files and their merge in input order), ``summary`` (``RunSummary``), ``progress``
(the progress bar with token rates).
"""

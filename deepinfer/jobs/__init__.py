"""Batch jobs: input records, resume, output records, part files and their merge, the one
drain-and-write loop and the run summary; the one-engine, DP and PD runs of
``deepinfer-generate`` on top of them (above ``deepinfer.distributed``).

Modules: ``input_records`` (parse input lines, resolve sampling into ``JobRequest`` s),
``input_lines`` (line reading), ``openai_batch`` and ``formats`` (the OpenAI batch format,
format choice), ``output_records`` (write and show output lines), ``resume_keys`` (the one
valid-line rule and the key of a line), ``resume`` (ids already done, pending records),
``parts`` (per-rank part files and their merge in input order), ``run_loop`` (the one
loop: submit, drain, write, show, count), ``summary`` (``RunSummary``), ``progress``
(the progress bar with token rates); the run modes ``one_engine``, ``dp_job`` and
``pd_job``.
"""

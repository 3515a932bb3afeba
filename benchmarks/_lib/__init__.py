"""The benchmarks' shared infrastructure: internal, not run directly (the scripts are ``benchmarks/*.py``).

:mod:`.common` (launching a job's ranks, timing its steps, the results path and report writer),
:mod:`.paired` (the paired statistic: ratios within a round, the ideal held out of the round it judges),
:mod:`.gpt_pipeline` (one job of the GPT pipeline as data, :class:`~.gpt_pipeline.JobSpec`, and its runner),
:mod:`.harness` (interleaved rounds, the comparison, the report's header and the shared options),
:mod:`.levels` (a dynamism timed at a few levels: stage loads, imbalance, projection),
:mod:`.calibration` (the calibration models and the step a profile predicts),
:mod:`.trace_cases` (recorded traces and cost curves -> per-step layer costs, for the replay and the
projection) and :mod:`.trained` (the trained-state trace recorder behind ``python -m benchmarks.trained``).
"""

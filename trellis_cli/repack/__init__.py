"""`trellis repack`: a checkpoint rewritten into another layout, staged, resumable and verified.

This package is the format-neutral skeleton: `run_repack` (run.py; `trellis_cli.run_repack` hands it the
validator), the registry's driver for (source dialect, `--to`) (drivers.py), and the one staged run around it
(staged_run.py, staging.py, lock.py, out_paths.py). Each conversion's driver lives in its dialect's package
(`Dialect.drivers`; the contract is dialects/conversion.py). Nothing is imported here, so importing one module of
the package loads only what that module needs.
"""

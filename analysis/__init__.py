"""kvbench analysis: run results (result.json files or W&B runs) -> tables and figures.

Reads result files only; never imports kvbench internals (docs/design.md §1). Entry point:
``python -m analysis {main-table,ablation,ruler,plot,frontier} RUNS_DIR``.
"""

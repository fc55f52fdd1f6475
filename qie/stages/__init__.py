"""Stage runners: read the composed config, build what the stage needs, run it.

Each `run(cfg, run_dir)` is what `python -m qie.<stage>` calls and what the Python API delegates to.
"""

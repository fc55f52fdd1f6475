"""The Hydra config tree, installed as the package `qie.conf` (`package_dir` in setup.cfg)."""

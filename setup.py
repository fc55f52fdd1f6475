"""Packaging beside setup.cfg (which holds the rest): the packages are those under `qie/` plus `qie.conf`, the
config tree at the repository root (`conf/`, mapped by `package_dir` in setup.cfg), and qie's Hydra plugin
(`hydra_plugins/qie_search`: Hydra builds sweepers only from that namespace); setup.cfg's `find:` cannot name a
package that lives outside the folder it searches."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["qie", "qie.*"]), "qie.conf", "hydra_plugins.qie_search"])

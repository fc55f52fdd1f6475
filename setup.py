"""Packaging beside setup.cfg (which holds the rest): the packages are those under `qie/` plus `qie.conf`, the
config tree at the repository root (`conf/`, mapped by `package_dir` in setup.cfg), and qie's Hydra plugin
(`hydra_plugins/qie_search`: Hydra builds sweepers only from that namespace); setup.cfg's `find:` cannot name a
package that lives outside the folder it searches.

`hydra_plugins` itself is listed, a namespace package (no `__init__.py`): an editable install (`pip install -e .`)
then maps the namespace to this checkout's `hydra_plugins/` folder, where Hydra's plugin scan (`pkgutil` over the
namespace's path) finds `qie_search` from any working directory. Listed alone, `hydra_plugins.qie_search` was
importable but not seen by that scan outside the checkout's root."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["qie", "qie.*"]), "qie.conf", "hydra_plugins", "hydra_plugins.qie_search"])

"""`python -m qie.cache action=stats|clear|verify|gc|sync ...`: the cache admin command. Its entry point is
`qie.cache_admin`, beside the other stages' (its `action=gc` reads data sets and model configs, which this storage
package never imports); it is run here by name."""

import runpy

if __name__ == "__main__":
    runpy.run_module("qie.cache_admin", run_name="__main__", alter_sys=True)

"""Plug-ins written outside qie, as a user's own package would be: configured by `_target_` alone."""

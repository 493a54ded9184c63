"""specserve's tooling: the ``specserve`` command line, benchmarks, drafter training and tuning.

It drives the engine from outside, through its public API, as a user would; the runtime
(``engine``, ``server``) never imports it.
"""

"""Benchmark tool for EAGLE3_DYNAMIC: ``python -m sglang_dynspec.bench``.

Talks to running SGLang servers over HTTP only (no ``sglang`` import), so it
runs anywhere with Python 3.10+, ``aiohttp``, ``tqdm`` and
``prometheus_client`` (plus ``matplotlib`` for ``plot``).

Modules:

* :mod:`.client`  -- streamed ``/generate`` requests, closed-loop load;
* :mod:`.stats`   -- pure statistics (percentiles, ITL, gaps near switches);
* :mod:`.scrape`  -- Prometheus ``/metrics`` scraping of the plugin's mode;
* :mod:`.fmt`     -- milliseconds and ``n/a``-aware number formatting;
* :mod:`.sweep`, :mod:`.ramp`, :mod:`.plot` -- the three subcommands;
* :mod:`.records` -- JSONL result files and their schemas.

The fake SGLang server for tests and dry runs is ``dynspec_testbed.fake_server``
(the test-bed distribution in ``testbed/``).
"""

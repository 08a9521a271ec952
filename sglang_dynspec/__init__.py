"""sglang-dynspec: EAGLE-3 speculative decoding that steps aside under load.

Adds ``--speculative-algorithm EAGLE3_DYNAMIC`` to SGLang through its plugin entry
points. Importing this package does not import SGLang; the entry point
(``sglang_dynspec.plugin:register``) does, when SGLang loads plugins.
"""

from sglang_dynspec._version import __version__

__all__ = ["__version__"]

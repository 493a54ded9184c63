"""Benchmarks and tuning commands (``specserve bench``, ``specserve tune``).

They drive the engine from outside, as a user would; nothing in the engine's runtime imports
them."""

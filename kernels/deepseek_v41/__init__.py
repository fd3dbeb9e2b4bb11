"""DeepSeek-V4.1's ops whose arithmetic differs from V4's: torch references (reference.py, the spec) and
their Triton kernels (fused.py), dispatched as the kernels API's `v41_<name>` (kernels/__init__.py)."""
